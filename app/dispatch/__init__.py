"""The queue contract between the API (producer) and the workers: queue and task names, one
`Dispatcher` protocol, its Celery producer (messages sent by task name) and a recording stub."""
