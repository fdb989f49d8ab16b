"""Request bodies of FastDeploy's EPLB routes: read with limits, then validated by pydantic models.

:func:`read_json_object` reads at most ``max_bytes`` (413 beyond), refuses NaN / Infinity, JSON nested deeper than
``max_depth``, a key given twice in one object and anything but an object (400). The models forbid unknown fields
and take values strictly (no ``"1"`` for 1, no 1.0 for 1, no 1 for true); loads are integers in [0, 2**53]. Every
refusal is an :class:`~fdeplb.errors.InputError` with a one-line message naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from fdeplb.errors import InputError, PayloadTooLargeError
from fdeplb.placement import MAX_LOAD
from fdeplb.placement.documents import unique_keys
from fdeplb.store.cluster_config import COMMAND_LINE_ONLY

#: most entries of ``ips`` (FastDeploy's shared-memory limit is 1 KiB of text: a few dozen addresses)
MAX_IPS = 4096
#: most MoE layers / logical experts accepted in a load array (the cluster's own shape is checked after this)
MAX_LAYERS = 4096
MAX_EXPERTS = 65536

LoadValue = Annotated[StrictInt, Field(ge=0, le=MAX_LOAD)]
Address = Annotated[StrictStr, Field(min_length=1, max_length=255)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    user: StrictStr | None = Field(None, max_length=1024, description="API user (FastDeploy's field)")
    passwd: StrictStr | None = Field(None, max_length=1024, description="API password (FastDeploy's field)")


class RearrangeBody(_Body):
    """``POST /rearrange_experts``."""

    action: StrictStr = Field("", max_length=64,
                              description='"" (start a round), "recv_expert_weight" or "update_weight_from_tensor"')
    plan_id: StrictStr | None = Field(None, min_length=1, max_length=64,
                                      description="update_weight_from_tensor: commit only if this is the staged plan "
                                                  "(refused with 409 otherwise); omitted: whatever is staged")
    ips: list[Address] | None = Field(None, max_length=MAX_IPS,
                                      description="API addresses HOST:PORT of registered ranks (action \"\")")
    data: list[Annotated[list[LoadValue], Field(max_length=MAX_EXPERTS)]] | None = Field(
        None, max_length=MAX_LAYERS, description="expert_load [num_layers][num_logical_experts] (recv_expert_weight)")


class _OperatorBody(BaseModel):
    """fdeplb's own operator routes (``/v1/round/*``, ``/v1/config``, ``/v1/cluster/delete``): HTTP Basic, no
    FastDeploy credential fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    reason: StrictStr = Field("", max_length=500, description="why (kept in the audit record)")


class ReasonBody(_OperatorBody):
    """``POST /v1/round/abort`` and ``POST /v1/round/cancel``."""


class PlanBody(_OperatorBody):
    """``POST /v1/round/plan``: one round to this placement (``fdeplb rearrange --plan``'s twin)."""

    phy2log: list[Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1, max_length=MAX_EXPERTS)]] = \
        Field(..., min_length=1, max_length=MAX_LAYERS,
              description="the placement [num_layers][num_physical_experts]: the logical expert of every slot")


class DeleteBody(_OperatorBody):
    """``POST /v1/cluster/delete``."""

    force: StrictBool = Field(False, description="delete even while agents or a coordinator are alive")


class DeadlinesBody(BaseModel):
    """The deadlines ``POST /v1/config`` may change (ms), any subset."""

    model_config = ConfigDict(extra="forbid", strict=True)

    collecting_ms: StrictInt | None = None
    loading_ms: StrictInt | None = None
    commit_ms: StrictInt | None = None
    swapping_ms: StrictInt | None = None
    weights_ms: StrictInt | None = None
    exclude_ms: StrictInt | None = None
    request_ttl_ms: StrictInt | None = None


class ConfigBody(_OperatorBody):
    """``POST /v1/config``: the settings to change (as ``fdeplb config set``); fields left out stay."""

    policy: StrictStr | None = Field(None, max_length=64)
    min_gain: float | None = Field(None, description="in [0, 1]")
    cordoned: StrictBool | None = None
    retain_rounds: StrictInt | None = None
    audit_keep: StrictInt | None = Field(
        None, description="refused (400): set only on the command line, which checks the export against --audit-dir")
    audit_export_path: StrictStr | None = Field(
        None, max_length=4096, description="refused (400): set only on the command line, inside --audit-dir")
    deadlines: DeadlinesBody | None = None

    def changes(self) -> dict[str, Any]:
        """The settings given, in :meth:`fdeplb.store.ClusterConfig.with_settings`' form. :class:`InputError`
        (400, nothing changed) when the body names a setting of
        :data:`~fdeplb.store.cluster_config.COMMAND_LINE_ONLY` (even as null)."""
        fixed = sorted(set(COMMAND_LINE_ONLY) & self.model_fields_set)
        if fixed:
            raise InputError(f"{', '.join(fixed)} cannot be changed over the API: the audit export is a file the "
                             f"coordinators write inside their --audit-dir, which this server cannot check, so it is "
                             f"set only on the command line (`fdeplb init-cluster` / `fdeplb config set --audit-keep N "
                             f"--audit-export FILE --audit-dir DIR`); nothing was changed")
        out = self.model_dump(exclude_none=True, exclude={"reason"})
        if "deadlines" in out and not out["deadlines"]:
            del out["deadlines"]
        return out


class StatsBody(_Body):
    """``POST /get_per_expert_tokens_stats``."""

    clear_stat: StrictBool = Field(False, description="accepted; fdeplb's windows slide (nothing to clear)")


class CheckBody(_Body):
    """``POST /check_redundant``."""

    action: StrictStr = Field("", max_length=64, description='"" (status) or "check_load_weight_result"')
    check_get_workloads: StrictBool = Field(False, description="with action \"\": add placement and snapshot")


def _no_constant(name: str) -> Any:
    raise InputError(f"body holds {name}, which is not JSON")


def _depth(doc: Any, limit: int) -> int:
    """Nesting depth of ``doc`` (iterative; stops counting past ``limit``)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def parse_json_object(raw: bytes, *, max_depth: int) -> dict:
    """``raw`` as a JSON object (an empty body is ``{}``); :class:`InputError` otherwise."""
    if not raw.strip():
        return {}
    try:
        doc = json.loads(raw, parse_constant=_no_constant, object_pairs_hook=unique_keys)  # a key twice: refused
    except RecursionError:
        raise InputError(f"body is nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, too-long integer literals
        raise InputError(f"body is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(doc, dict):
        raise InputError(f"body must be a JSON object, got {type(doc).__name__}")
    if _depth(doc, max_depth) > max_depth:
        raise InputError(f"body is nested deeper than {max_depth} levels")
    return doc


async def read_json_object(request, *, max_bytes: int, max_depth: int) -> dict:
    """Read a Starlette request's body (at most ``max_bytes``) as a JSON object.

    Raises :class:`PayloadTooLargeError` past the limit (the rest is not read) and :class:`InputError` for bad
    JSON (see the module doc)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise PayloadTooLargeError(f"body of {declared} bytes is over the limit of {max_bytes} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise PayloadTooLargeError(f"body is over the limit of {max_bytes} bytes")
    return parse_json_object(bytes(body), max_depth=max_depth)


def validate(model: type[BaseModel], doc: dict) -> Any:
    """``doc`` as ``model``; :class:`InputError` with the first problem on one line."""
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise InputError(f"{where}: {err.get('msg', 'invalid')}{more}") from None


def openapi_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` documenting ``model`` as the JSON request body of a route that reads it itself."""
    return {"requestBody": {"required": False,
                            "content": {"application/json": {"schema": model.model_json_schema()}}}}
