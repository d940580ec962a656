"""A training run: the loop (``loop``) and its parts, one concern each: the task (``task``), the epochs (``epoch``),
each epoch's row and findings (``rows``, ``diagnose``), checkpoints, the run folder (``run_dir``), the data events
and recorded keys (``lineage``), the data-wait meter, time to first batch, and the views (``plot``)."""
