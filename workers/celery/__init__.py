"""The Celery glue: the worker's app, its task adapters and a look into the broker."""
