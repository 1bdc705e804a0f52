"""The dashboard served for real over HTTP, against a real Redis holding a real RQ queue, job and worker."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request

import pytest
from rq import Queue, Worker
from rq.serializers import JSONSerializer
from werkzeug.serving import make_server

from dflashq.exceptions import ConfigError
from dflashq.keys import EXTRACT_FUNCTION, Keys
from ops.dashboard import make_app


@pytest.fixture
def populated(conn):
    """Run `dash` with one queued chunk job and one registered worker; run `other` with its own queue and worker."""
    queues = {}
    for run, worker_name in (("dash", "host.gpu0"), ("other", "host.gpu1")):
        queue = Queue(Keys(run).shared_queue, connection=conn, serializer=JSONSerializer)
        queue.enqueue(EXTRACT_FUNCTION, {"id": f"{run}-chunk"}, job_id=f"{run}-chunk")
        Worker([queue], name=worker_name, connection=conn, serializer=JSONSerializer).register_birth()
        queues[run] = queue
    return queues


def _serve(redis_url, **options):
    server = make_server("127.0.0.1", 0, make_app(redis_url, "dash", **options), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


@pytest.fixture
def dashboard(redis_url, request):
    server, base = _serve(redis_url, **getattr(request, "param", {}))
    yield base
    server.shutdown()


def _get(url, method="GET", auth=None):
    req = urllib.request.Request(url, method=method)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_pages_and_json_show_the_run_queue_and_worker(populated, dashboard):
    assert _get(dashboard + "/")[0] == 200
    assert _get(dashboard + "/0/view/workers")[0] == 200
    status, body = _get(dashboard + "/0/data/queues.json")
    assert status == 200
    assert [q["name"] for q in json.loads(body)["queues"]] == ["dflashq-dash"]  # not run `other`'s queue
    status, body = _get(dashboard + "/0/data/workers.json")
    assert [(w["name"], w["queues"]) for w in json.loads(body)["workers"]] == [("host.gpu0", ["dflashq-dash"])]
    status, body = _get(dashboard + "/0/data/jobs/dflashq-dash/queued/8/asc/1.json")
    assert status == 200 and "dash-chunk" in body
    status, body = _get(dashboard + "/0/view/jobs/dflashq-dash/queued/8/asc/1")
    assert status == 200 and "dflashq-dash" in body


def test_actions_that_change_queues_are_refused_by_default(populated, dashboard):
    for path in ("/job/dash-chunk/delete", "/queue/dflashq-dash/queued/empty", "/requeue/dflashq-dash",
                 "/job/dash-chunk/requeue", "/queue/dflashq-dash/compact"):
        assert _get(dashboard + path, method="POST")[0] == 403, path
    assert populated["dash"].count == 1  # the job is still queued


@pytest.mark.parametrize("dashboard", [{"allow_delete": True}], indirect=True)
def test_allow_delete_lets_the_queue_be_emptied(populated, dashboard):
    status, body = _get(dashboard + "/queue/dflashq-dash/queued/empty", method="POST")
    assert status == 200 and json.loads(body)["status"] == "OK"
    assert populated["dash"].count == 0


@pytest.mark.parametrize("dashboard", [{"username": "ops", "password": "s3cret"}], indirect=True)
def test_basic_auth_guards_every_route(populated, dashboard):
    for path in ("/", "/0/data/queues.json", "/0/data/workers.json", "/static/css/main.css"):
        assert _get(dashboard + path)[0] == 401, path
        assert _get(dashboard + path, auth=("ops", "wrong"))[0] == 401, path
    assert _get(dashboard + "/", auth=("ops", "s3cret"))[0] == 200
    assert _get(dashboard + "/static/css/main.css", auth=("ops", "s3cret"))[0] == 200
    status, body = _get(dashboard + "/0/data/queues.json", auth=("ops", "s3cret"))
    assert status == 200 and "dflashq-dash" in body


def test_username_without_password_is_a_config_error(redis_url):
    with pytest.raises(ConfigError):
        make_app(redis_url, "dash", username="ops")
