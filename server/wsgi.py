"""Deployment entry: ``app`` for any WSGI server, configured by $SPLITLEARN_ARGS / $SPLITLEARN_TOKEN.

    SPLITLEARN_ARGS="--model gpt2 --cut 2 --cut 10" waitress-serve --listen 127.0.0.1:8000 wsgi:app
"""
from splitlearn.server.http.wsgi import create_app_from_env

app = create_app_from_env()
