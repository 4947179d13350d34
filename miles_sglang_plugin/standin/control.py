"""The stand-in engine's control routes, with the state a real engine keeps (NOT a real SGLang engine).

What a trainer calls on its engines between rollouts (SGLang 0.5.23's routes, ``http_server.py``), answered as
SGLang's own server answers them (held to it by ``tests/test_engine_contract.py``, run against both):

* every control route takes a JSON object body, also on GET: none is a 400 (SGLang's FastAPI validation,
  ``{"object": "error", "message": ..., "type": "Bad Request", "param": null, "code": 400}``), and so is a body
  that SGLang's request class of the route does not take (checked against it, read from its ``io_struct.py``
  where SGLang is installed, the shipped 0.5.23 description otherwise). Stricter than SGLang in two places, on
  purpose: a field the class does not have and an unknown memory tag are refused (SGLang ignores the one and
  records the other).
* ``/release_memory_occupation`` / ``/resume_memory_occupation`` (``tags``: ``weights``, ``kv_cache``,
  ``cuda_graph``; none: all) answer 200 ``null``. With ``--enable-memory-saver`` a released engine cannot
  serve: ``/generate`` and the OpenAI routes answer 503 and ``/update_weights_from_disk`` is refused while the
  weights are released (a GPU engine's memory is gone; not checked against a real GPU engine). Without it,
  as SGLang on a machine without the memory saver, nothing is released and the engine keeps serving. Resuming
  memory that was not released kills SGLang's scheduler (``KeyError`` on its set of released tags): the
  stand-in exits too (code 5), without answering.
* ``/update_weights_from_disk``, ``/init_weights_update_group`` (the engine's ranks ``rank_offset .. rank_offset
  + tp*pp - 1`` must lie in ``1 .. world_size - 1``: rank 0 is the trainer), ``/update_weights_from_distributed``
  (needs that group), ``/destroy_weights_update_group`` (400 ``{"success": false, ...}`` for a group that does
  not exist, as SGLang), ``/update_weight_version``. The weight version they set is what ``/model_info``
  and each response's ``meta_info`` report (``/server_info`` keeps the start-up ``--weight-version``, as
  SGLang's; SGLang 0.5.23 has no ``/get_weight_version``).
* ``/pause_generation`` (``abort``, ``retract``, ``in_place``) and ``/continue_generation``: generation requests
  that arrive while paused wait for ``continue`` (in SGLang's tokenizer manager), whatever the mode; an abort of
  all requests (``/abort_request`` with ``abort_all``, a pause in ``abort`` mode, ``abort_all_requests`` of a
  weight update) does not reach them: they run after ``continue``, as SGLang's do. A streamed ``/generate``
  paced by the speed model that runs when all requests are aborted ends with the tokens it has and SGLang's
  abort finish reason; a request answered at once, or whole, has nothing left to abort.
* ``/load_lora_adapter`` / ``/unload_lora_adapter`` (only with ``--enable-lora``, else 400 with SGLang's
  ``{"success": false, "error_message": "LoRA is not enabled. ..."}``); loaded adapters are listed by
  ``/v1/models`` (as SGLang lists them) and ``/stand_in/stats``.

``MSP_STANDIN_CONTROL_LATENCY_S`` makes each control call take that long (a real engine's take from a fraction
of a second to minutes). A ``/update_weights_from_disk`` then loads for that long: ``abort_all_requests`` ends
what runs when the call comes, and generation requests that arrive meanwhile wait until the load is done (SGLang's
scheduler serves nothing while it loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from miles_sglang_plugin.standin.common import BodyError, Refusal, RequestError, control_body

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
CONTROL_LATENCY_ENV = "MSP_STANDIN_CONTROL_LATENCY_S"
#: Exit code of a stand-in whose (emulated) scheduler crashed as SGLang's does.
EXIT_CRASHED = 5
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
#: What a handler returns for an empty 200 answer (``None`` is JSON ``null``).
EMPTY = object()


class SchedulerCrash(Exception):
    """A call that makes SGLang's scheduler raise and the engine exit: the stand-in exits without answering."""


@functools.cache
def request_schemas() -> Any:
    """SGLang's request classes (lazily: only the first control call reads them)."""
    from miles_sglang_plugin.rendering.sglang_requests import load_request_schemas

    return load_request_schemas()


@dataclass
class ControlState:
    """What the control routes change, and what generation and the info routes read."""

    enable_lora: bool = False
    #: ``--enable-memory-saver``: released memory is gone (no serving until resumed); without it nothing is.
    memory_saver: bool = False
    tp_size: int = 1
    pp_size: int = 1
    latency_s: float = 0.0
    weight_version: str = "default"
    model_path: str = ""
    #: Successful weight loads (from disk or through a weights update group).
    weight_updates: int = 0
    released_tags: set[str] = field(default_factory=set)
    #: The pause mode while paused, else None.
    paused: str | None = None
    lora_adapters: dict[str, str] = field(default_factory=dict)
    #: group name -> the ``/init_weights_update_group`` body that created it.
    weight_groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Control calls received, in order: ``[route, body]`` (the last 500).
    calls: deque[list[Any]] = field(default_factory=lambda: deque(maxlen=500))
    #: The routes of the control calls received and not answered yet (told in the log when the engine stops).
    unanswered: list[str] = field(default_factory=list)
    #: Aborts of all requests received (none reaches a request waiting for ``continue``, as in SGLang).
    aborts: int = 0
    #: The checkpoint of the last ``/update_weights_from_disk`` (None: the one it started with).
    disk_model_path: str | None = None
    #: Weight loads from disk under way (with a control latency, the load takes that long): new generation
    #: requests wait for them, as SGLang's scheduler runs nothing while it loads.
    loading: int = 0
    _resumed: asyncio.Event | None = None
    _loaded: asyncio.Event | None = None

    # -------------------------------------------------------------------------------------------- generation
    def generation_refusal(self) -> str | None:
        """Why a generation request cannot be served now (None: it can): memory released with the memory
        saver on."""
        if self.released_tags and self.memory_saver:
            return (
                f"stand-in engine: memory released ({', '.join(sorted(self.released_tags))}); "
                "call /resume_memory_occupation before generating"
            )
        return None

    def resumed(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            if self.paused is None:
                self._resumed.set()
        return self._resumed

    def loaded(self) -> asyncio.Event:
        if self._loaded is None:
            self._loaded = asyncio.Event()
            if not self.loading:
                self._loaded.set()
        return self._loaded

    async def wait_until_running(self) -> None:
        """Wait while generation is paused (an abort of all requests does not end the wait, as in SGLang) and
        while weights load."""
        while self.paused is not None or self.loading:
            await self.resumed().wait()
            await self.loaded().wait()

    @contextlib.contextmanager
    def loading_weights(self) -> Iterator[None]:
        """A weight load is under way for the block."""
        self.loading += 1
        self.loaded().clear()
        try:
            yield
        finally:
            self.loading -= 1
            if not self.loading:
                self.loaded().set()

    def abort_all(self) -> None:
        self.aborts += 1

    def stats(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "loaded_model_path": self.model_path,
            "weight_updates": self.weight_updates,
            "released_memory_tags": sorted(self.released_tags),
            "paused": self.paused,
            "lora_adapters": dict(self.lora_adapters),
            "weight_update_groups": {name: dict(body) for name, body in self.weight_groups.items()},
            "control_calls": [list(call) for call in self.calls],
        }


CONTROL: web.AppKey[ControlState] = web.AppKey("standin_control", ControlState)

Handler = Callable[[ControlState, dict[str, Any]], Any]


def _tags(body: dict[str, Any]) -> set[str]:
    tags = body.get("tags")
    if not tags:  # SGLang: None or [] is all of them
        return set(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise RequestError(400, f"unknown memory tags {unknown}; valid: {', '.join(MEMORY_TAGS)}")
    return set(tags)


def _require_weights(state: ControlState, what: str) -> None:
    if "weights" in state.released_tags and state.memory_saver:
        raise RequestError(
            400,
            f"stand-in engine: {what} while the weights are released; resume them first (tags=['weights'])",
        )


def release_memory(state: ControlState, body: dict[str, Any]) -> None:
    state.released_tags |= _tags(body)
    return None  # SGLang answers 200 null


def resume_memory(state: ControlState, body: dict[str, Any]) -> None:
    tags = _tags(body)
    not_released = sorted(tags - state.released_tags)
    if not_released:  # SGLang's scheduler: self.offload_tags.remove(tag) -> KeyError, the engine exits
        raise SchedulerCrash(
            f"KeyError: {not_released[0]!r} (resume_memory_occupation of memory that was not released: "
            f"{', '.join(not_released)})"
        )
    state.released_tags -= tags
    return None


def _set_version(state: ControlState, version: Any) -> None:
    if version is not None:
        state.weight_version = str(version)


def update_weights_from_disk(state: ControlState, body: dict[str, Any]) -> dict[str, Any]:
    """(What was running was aborted when the call came: :func:`_route`.)"""
    _require_weights(state, "cannot load weights from disk")
    state.model_path = state.disk_model_path = body["model_path"]
    state.weight_updates += 1
    _set_version(state, body.get("weight_version"))
    version = body.get("weight_version")
    message = "Succeeded to update model weights." + (
        f" Weight version updated to {version}." if version is not None else ""
    )
    return {"success": True, "message": message, "num_paused_requests": 0}


def init_weights_update_group(state: ControlState, body: dict[str, Any]) -> dict[str, Any]:
    name = body.get("group_name", "weight_update_group")
    if name in state.weight_groups:
        raise RequestError(400, f"stand-in engine: weights update group {name!r} already exists")
    offset, world = body["rank_offset"], body["world_size"]
    engine_ranks = state.tp_size * state.pp_size
    if offset < 1 or offset + engine_ranks > world:
        raise RequestError(
            400,
            f"stand-in engine: ranks {offset}..{offset + engine_ranks - 1} of this engine (tp*pp = {engine_ranks}) "
            f"do not fit a group of world_size {world} whose rank 0 is the trainer",
        )
    state.weight_groups[name] = dict(body)
    return {"success": True, "message": f"stand-in engine: joined {name!r} as ranks from {offset}"}


def update_weights_from_distributed(state: ControlState, body: dict[str, Any]) -> dict[str, Any]:
    name = body.get("group_name", "weight_update_group")
    if name not in state.weight_groups:
        raise RequestError(400, f"stand-in engine: no weights update group {name!r}; init it first")
    if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
        raise RequestError(400, "stand-in engine: names, dtypes and shapes must be of one length")
    _require_weights(state, "cannot receive weights")
    if body.get("abort_all_requests"):
        state.abort_all()
    state.weight_updates += 1
    _set_version(state, body.get("weight_version"))
    return {"success": True, "message": f"stand-in engine: {len(body['names'])} tensors 'received'"}


def destroy_weights_update_group(state: ControlState, body: dict[str, Any]) -> dict[str, Any]:
    name = body.get("group_name", "weight_update_group")
    if state.weight_groups.pop(name, None) is None:
        raise Refusal(400, {"success": False, "message": "The group to be destroyed does not exist."})
    return {"success": True, "message": f"stand-in engine: {name!r} destroyed"}


def update_weight_version(state: ControlState, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("abort_all_requests", True):
        state.abort_all()
    _set_version(state, body["new_version"])
    return {
        "success": True,
        "message": f"Weight version updated to {state.weight_version}",
        "new_version": state.weight_version,
    }


def pause_generation(state: ControlState, body: dict[str, Any]) -> dict[str, Any]:
    state.paused = body.get("mode", "abort")
    state.resumed().clear()
    if state.paused == "abort":
        state.abort_all()
    return {"message": "Generation paused successfully.", "status": "ok"}


def continue_generation(state: ControlState, body: dict[str, Any]) -> dict[str, Any]:
    state.paused = None
    state.resumed().set()
    return {"message": "Generation continued successfully.", "status": "ok"}


def abort_request(state: ControlState, body: dict[str, Any]) -> object:
    if body.get("abort_all"):
        state.abort_all()
    return EMPTY  # SGLang answers an empty 200


def _lora_refusal(message: str) -> Refusal:
    """SGLang's LoRA failure answer (``LoadLoRAAdapterReqOutput`` as JSON)."""
    body = {"rid": None, "http_worker_ipc": None, "success": False, "error_message": message}
    return Refusal(400, {**body, "loaded_adapters": None})


def load_lora_adapter(state: ControlState, body: dict[str, Any]) -> dict[str, Any]:
    if not state.enable_lora:
        raise _lora_refusal(LORA_DISABLED)
    name = body["lora_name"]
    if name in state.lora_adapters:
        raise _lora_refusal(f"stand-in engine: a LoRA adapter named {name!r} is already loaded")
    state.lora_adapters[name] = body["lora_path"]
    return {"success": True, "error_message": None, "loaded_adapters": dict(state.lora_adapters)}


def unload_lora_adapter(state: ControlState, body: dict[str, Any]) -> dict[str, Any]:
    if not state.enable_lora:
        raise _lora_refusal(LORA_DISABLED)
    name = body["lora_name"]
    if state.lora_adapters.pop(name, None) is None:
        raise _lora_refusal(f"stand-in engine: no LoRA adapter named {name!r} is loaded")
    return {"success": True, "error_message": None, "loaded_adapters": dict(state.lora_adapters)}


#: route -> handler; each body is checked against SGLang's request class of the route first.
HANDLERS: dict[str, Handler] = {
    "/release_memory_occupation": release_memory,
    "/resume_memory_occupation": resume_memory,
    "/update_weights_from_disk": update_weights_from_disk,
    "/init_weights_update_group": init_weights_update_group,
    "/update_weights_from_distributed": update_weights_from_distributed,
    "/destroy_weights_update_group": destroy_weights_update_group,
    "/update_weight_version": update_weight_version,
    "/pause_generation": pause_generation,
    "/continue_generation": continue_generation,
    "/abort_request": abort_request,
    "/load_lora_adapter": load_lora_adapter,
    "/unload_lora_adapter": unload_lora_adapter,
}
#: Routes SGLang also serves on GET (with a body all the same).
GET_TOO = ("/release_memory_occupation", "/resume_memory_occupation")


def _route(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def serve(request: web.Request) -> web.StreamResponse:
        state = request.app[CONTROL]
        body = await control_body(request)
        schemas = request_schemas()
        problems = schemas.problems(request.path, body)
        if problems:
            raise BodyError(
                f"stand-in engine: not a valid body (checked against {schemas.source}): {'; '.join(problems)}"
            )
        state.calls.append([request.path, body])
        state.unanswered.append(request.path)
        loads = request.path == "/update_weights_from_disk"
        if loads and body.get("abort_all_requests"):
            state.abort_all()  # at once, as SGLang does before it waits to load
        try:
            if state.latency_s:
                with state.loading_weights() if loads else contextlib.nullcontext():
                    await asyncio.sleep(state.latency_s)
            answer = handler(state, body)
        finally:
            state.unanswered.remove(request.path)
        return web.Response(status=200) if answer is EMPTY else web.json_response(answer)

    return serve


def control_routes() -> list[web.RouteDef]:
    routes = [web.post(path, _route(handler)) for path, handler in HANDLERS.items()]
    routes += [web.get(path, _route(HANDLERS[path])) for path in GET_TOO]
    return routes
