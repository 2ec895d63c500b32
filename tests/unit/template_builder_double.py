"""A stand-in for a node's template builder, for the template API tests only.

``nodes.client.build_template`` is replaced by ``FakeBuilder``: every build handed to the
(mocked) node runs ``script(builder, build_id, spec)`` in a thread, reporting through the
real ``template_builds.progress`` API exactly as the node's builder will (accept, report,
finish). It builds nothing."""
from __future__ import annotations

import threading

from django.db import connections

from template_builds import progress


def succeed(builder: "FakeBuilder", build_id: str, spec: dict) -> None:
    """Logs a line per step (waiting for ``builder.release`` first), then finishes ready
    with ``builder.result``."""
    assert progress.accept(build_id, builder.node_id)
    builder.accepted.set()
    base = spec["from_image"] or (spec["from_template"] or {}).get("ref")
    progress.report(build_id, "info", f"[base] FROM {base}", step="base")
    if not builder.release.wait(20):
        raise AssertionError("the test never released the build")
    total = len(spec["steps"])
    for i, step in enumerate(spec["steps"], start=1):
        if not progress.report(build_id, "info", f"[builder {i}/{total}] {step['type']} {' '.join(step['args'])}",
                               step=str(i)):
            builder.cancelled.append(build_id)
            return
    for i in range(builder.extra_lines):
        progress.report(build_id, "debug", f"line {i}", step="finalize")
    progress.finish(build_id, builder.result)


def fail_at_last_step(builder: "FakeBuilder", build_id: str, spec: dict) -> None:
    assert progress.accept(build_id, builder.node_id)
    step = str(len(spec["steps"]))
    progress.report(build_id, "error", "[stderr]: exit 3", step=step)
    progress.finish(build_id, error="failed to run command 'exit 3': exit status 3", step=step)


class FakeBuilder:
    def __init__(self, node_id: str):
        self.node_id = node_id
        self.calls: list[dict] = []
        self.script = succeed
        self.release = threading.Event()
        self.release.set()
        self.accepted = threading.Event()  # set once a build is accepted: the test may act mid-build
        self.result = progress.BuildResult(image="tpl-image", details={"user": "user", "workdir": "/home/user"})
        self.extra_lines = 0
        self.cancelled: list[str] = []
        self.errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    async def __call__(self, node, *, build_id, template_id, spec, cpu_count, memory_mb, disk_size_mb, **kwargs):
        self.calls.append(dict(node=node.pk, build_id=build_id, template_id=template_id, spec=spec,
                               cpu_count=cpu_count, memory_mb=memory_mb, disk_size_mb=disk_size_mb))
        thread = threading.Thread(target=self._run, args=(self.script, build_id, spec), daemon=True)
        self._threads.append(thread)
        thread.start()
        return f"task-{build_id}"

    def _run(self, script, build_id: str, spec: dict) -> None:
        try:
            script(self, build_id, spec)
        except BaseException as exc:  # noqa: BLE001 - re-raised by join() in the test
            self.errors.append(exc)
        finally:
            connections.close_all()

    def join(self) -> None:
        self.release.set()
        for thread in self._threads:
            thread.join(30)
        if self.errors:
            raise self.errors[0]
