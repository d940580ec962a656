"""Reports people read to judge a dataset, a feature cache or a training run, drawn only from the files shardcache
already writes (manifests, ``metrics.jsonl``), never from live state, so any folder can be reported on after the
fact. Nothing here is imported by the hot paths: the training curves (``curves``) import matplotlib only when a
figure is drawn, so importing the training loop stays fast.
"""
