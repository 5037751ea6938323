"""flexh2o-serve: an OpenAI-compatible HTTP server on one engine. Requests enter a bounded live queue (live.py); one
engine thread (worker.py) runs refill runs whose rows take them at step boundaries (feed.py); the ASGI app (app.py)
only validates (schemas.py), enqueues and streams (stream.py, responses.py)."""
