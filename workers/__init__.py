"""Celery app and tasks, the vLLM engine adapter, and the domain steps workers run."""
