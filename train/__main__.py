"""``python -m train``: the same as ``train-from-shards`` (handy under ``torchrun -m train``)."""

from train.cli import train_command

if __name__ == "__main__":
    train_command()
