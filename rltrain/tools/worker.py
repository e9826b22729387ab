"""A tool worker: a process of its own that loads the run's tools and executes their calls, one at a time.

The driver (`rltrain.tools.ToolRunner`) starts a pool of these with `python -m rltrain.tools.worker CONFIG`
so that no tool ever runs in the training driver: a tool that crashes, hangs or kills its own process costs
that one call (the runner kills and replaces the worker and the row gets an error observation), never the
run. The protocol is JSON lines, nothing is unpickled: the worker answers `{"ready": true}` (or `{"error":
...}` when a tool cannot be loaded), then for each request `{"tool", "arguments"}` one `{"text", "error"}`.
The protocol uses the worker's original stdout; whatever a tool prints goes to stderr. The worker dies with
its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any


def _call(tools: dict[str, Any], request: dict[str, Any], max_chars: int) -> dict[str, Any]:
    tool = tools.get(request.get("tool"))
    if tool is None:
        return {
            "text": f"error: unknown tool {request.get('tool')!r}; tools: {', '.join(tools)}",
            "error": True,
        }
    try:
        result = tool(request.get("arguments") or {})
    except Exception as exc:  # any failure of the tool is shown to the model, never ends the run
        return {"text": f"error: {type(exc).__name__}: {exc}", "error": True}
    text = str(result)
    # A little past the runner's cut, so that it still sees (and marks) an output that was too long.
    return {"text": text[: max_chars + 16], "error": bool(getattr(result, "error", False))}


def main() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the driver
    config = json.loads(sys.argv[1])
    if os.getppid() != config["parent_pid"]:
        sys.exit(1)
    sys.path[:] = config["sys_path"]
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # a tool's prints must not mix with the protocol
    sys.stdout = sys.stderr

    def send(message: dict[str, Any]) -> None:
        proto.write(json.dumps(message) + "\n")
        proto.flush()

    from rlconf.plan.run import ToolPlan
    from rltrain.tools import load_tools

    try:
        fields = config["multi_turn"]
        plan = ToolPlan(**{**fields, "tools": tuple(fields["tools"])})
        tools = {t.name: t for t in load_tools(plan)}
    except Exception as exc:  # reported to the runner, which turns every call into an error observation
        send({"error": f"{type(exc).__name__}: {exc}"})
        return
    send({"ready": True})
    for line in sys.stdin:
        send(_call(tools, json.loads(line), config["max_chars"]))


if __name__ == "__main__":
    main()
