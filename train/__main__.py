"""``python -m train``: the same as ``train-from-shards``.

Under torchrun start the console script (``torchrun --no-python train-from-shards``): ``-m train`` resolves
``train`` from the working directory first, where a user's own ``train.py`` would run instead."""

from train.cli import train_command

if __name__ == "__main__":
    train_command()
