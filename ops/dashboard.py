"""`dflashq dashboard`: rq-dashboard over the run's Redis, showing the run's queues and workers.

Safe by default: bound to 127.0.0.1, and every action that changes the queues (delete, empty, requeue, compact)
answers 403 unless `allow_delete`, because a chunk deleted or requeued behind the backlog accounting leaves the
run's budgets wrong. Optional HTTP basic auth covers every route, static files included.
"""

from __future__ import annotations

import hmac

import flask
import rq_dashboard.web as rq_web
from rq.serializers import JSONSerializer
from rq_dashboard.cli import make_flask_app
from werkzeug.serving import make_server

from dflashq.exceptions import ConfigError
from dflashq import defaults
from dflashq.keys import Keys

# rq-dashboard endpoints that change queues or jobs
MUTATING_ENDPOINTS = frozenset(
    f"rq_dashboard.{name}" for name in ("delete_job_view", "requeue_job_view", "requeue_all", "empty_queue", "compact_queue")
)


def _same(given: str | None, expected: str) -> bool:
    return hmac.compare_digest((given or "").encode(), expected.encode())  # constant time: no guessing by timing


def _narrowed(view, field: str, keep):
    """rq-dashboard's JSON listing `view`, keeping only the items of `field` that `keep` accepts."""

    def narrowed(instance_number):
        response, headers = view(instance_number)
        return flask.jsonify({field: [item for item in response.get_json()[field] if keep(item)]}), headers

    return narrowed


def make_app(redis_url: str, run: str, allow_delete: bool = False, username: str | None = None,
             password: str | None = None) -> flask.Flask:
    """The rq-dashboard Flask app for run `run`; its queue and worker lists hold only that run's."""
    if bool(username) != bool(password):
        raise ConfigError("Give both a dashboard username and a password, or neither.")
    rq_web.config.serializer = JSONSerializer  # dflashq jobs are JSON; rq-dashboard keeps this process-wide
    app = make_flask_app(None, None, None, "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = redis_url
    app.config["RQ_DASHBOARD_DISABLE_DELETE"] = not allow_delete  # also hides the buttons in the pages
    rq_web.setup_rq_connection(app)
    keys = Keys(run)

    @app.before_request
    def guard():
        if username:
            auth = flask.request.authorization
            if auth is None or not (_same(auth.username, username) and _same(auth.password, password)):
                return flask.Response("login required", 401, {"WWW-Authenticate": 'Basic realm="dflashq"'})
        if not allow_delete and flask.request.endpoint in MUTATING_ENDPOINTS:
            return flask.Response("actions that change queues are off: start the dashboard with --allow-delete", 403)
        return None

    views = app.view_functions
    views["rq_dashboard.list_queues"] = _narrowed(views["rq_dashboard.list_queues"], "queues",
                                                  lambda q: keys.is_run_queue(q["name"]))
    views["rq_dashboard.list_workers"] = _narrowed(views["rq_dashboard.list_workers"], "workers",
                                                   lambda w: any(keys.is_run_queue(name) for name in w["queues"]))
    return app


def serve_dashboard(redis_url: str, run: str, host: str = defaults.DASHBOARD_HOST, port: int = defaults.DASHBOARD_PORT, allow_delete: bool = False,
                    username: str | None = None, password: str | None = None) -> None:
    """Serve the dashboard until interrupted."""
    app = make_app(redis_url, run, allow_delete, username, password)
    make_server(host, port, app, threaded=True).serve_forever()
