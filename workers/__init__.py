"""Everything off the request path: the Celery app and tasks, intake, validation, the dispatcher,
the vLLM engine and the packs it runs, finalization and the S3 drop folders."""
