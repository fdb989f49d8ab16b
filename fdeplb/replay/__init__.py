"""Replay a recording (a self-contained audit export, see :mod:`fdeplb.recording`) through the machine tables, with
no Redis.

DESIGN.md section 4: the audit stream is complete, and replaying it through the tables must reproduce every state
and every plan. :func:`replay` drives one ``transitions`` machine per record key (built from the table exactly as a
live commit builds it, see :mod:`fdeplb.machines.model`) and checks, for every audit record in order:

- its stream id is after the previous record's (the export is in stream order);
- its machine is a table and its key a record of the cluster (``cluster``, ``rank:<r>`` / ``weights:<r>`` with
  0 <= r < ep_size);
- ``from`` is the state the replay holds for that key, ``trigger`` is legal from it and reaches ``to`` (per the
  table), and ``version`` is the key's previous version + 1 (no gap, no repeat);
- fences: a cluster record carries its coordinator's lease ``<n>:<holder>`` with ``actor`` the holder, and ``n``
  never goes backwards (one ``n`` is one lease); rank and weight records carry none;
- the transition's guards that span records held when it committed, on the records as the replay holds them
  (LOAD_SUCC / SWAPPING / DONE only with every rank LOADED / SWAPPED for that plan, a start only with every rank
  IDLE and every weight status NORMAL, no clear while a round is past FREE, a fail / abort only before the plan is
  committed, a ``load`` only with its plan in the recording);
- what a record says besides its states (the texts of :mod:`fdeplb.rounds.reasons`): the start that follows
  a start refused for stale ranks shows each of them fresh again (heartbeat age within its TTL); a cordoned
  cluster's commit names its external request; a weight ``updated`` names the cluster's current placement (an
  update reloads the current placement, never the initial one);
- an alarm, skip or start refusal (not transitions) names the cluster record in its replayed state and version;
  a skip or refusal only in FREE, a refusal only ranks of the cluster;
- membership: each membership transition raises the generation by exactly one and every transition
  carries the generation in force (an older one fails); a committed placement routes no expert only to EXCLUDED
  ranks (log2phy / logcnt over the members name no slot of an excluded rank); a weight cancel follows the
  withdrawal of a request no rank applied and returns to the state its clear / update came from;
- ``chain`` = :func:`chain_of` (the predecessor's chain, the record's fields): computed by the commit script, so a
  dropped, reordered, edited or forged record anywhere breaks it (the semantic checks above run first, so a record
  that also breaks them is reported with their reason).

Records whose trigger is ``alarm``, ``skip`` or ``start_refused`` are cluster outcomes, not transitions: the
record stays as it is.

:func:`check_plans` then recomputes every ``load`` transition's plan from its snapshot (from the recording, or from
a live :class:`~fdeplb.store.Store`) and checks the plan_id and ``new_phy2log``; :func:`check_gates` recomputes
the numbers of every gated round. :func:`whatif` replans every recorded round's snapshot with another policy.
:func:`rebuild` writes the replayed records into a Redis.

The first inconsistency raises :class:`~fdeplb.errors.ReplayError` naming the line (CLI exit 1).

Modules, one concern each:

- :mod:`~fdeplb.replay.recording_format`: the recording format (schema, line types, the strict line models) and its
  reader (:func:`parse_lines`, :func:`read_export`); :mod:`fdeplb.recording`, the writer, uses the same definitions;
- :mod:`~fdeplb.replay.report`: the report (:class:`ReplayReport`, the rounds and plans seen);
- :mod:`~fdeplb.replay.machine_replay`: :func:`replay` through the tables, :func:`chain_of`; beside it, each with
  its own concern, :mod:`~fdeplb.replay.reason_checks` (what a record says besides its states),
  :mod:`~fdeplb.replay.membership_checks` (the membership generation; no committed placement routes to an EXCLUDED
  rank), :mod:`~fdeplb.replay.weight_requests` (the cancel transitions' ``withdrawn`` guard) and
  :mod:`~fdeplb.replay.start_state` (``state_at``, the exporter's start state, no checks);
- :mod:`~fdeplb.replay.recompute`: :func:`check_plans`, :func:`check_gates`, :func:`whatif`, on top of
  :mod:`fdeplb.rounds.gating`;
- :mod:`~fdeplb.replay.header_checks`: the header's configuration against the notes and records that attest it
  (a mismatch fails at line 1), and the configuration each round ran with;
- :mod:`~fdeplb.replay.anchor`: ``check_head``, the recording's last chain against a live audit (``--redis-url``);
- :mod:`~fdeplb.replay.rebuild`: :func:`rebuild`;
- :mod:`~fdeplb.replay.verify`: ``check_recording``, the whole self-contained check of one file (``fdeplb replay``
  and the pytest plugin, :mod:`~fdeplb.replay.pytest_plugin`: ``pytest --fdeplb-recordings DIR``).
"""

from fdeplb.errors import ReplayError
from fdeplb.replay.machine_replay import chain_of, replay, replay_file
from fdeplb.replay.rebuild import rebuild
from fdeplb.replay.recompute import check_gates, check_plans, whatif
from fdeplb.replay.recording_format import parse_lines, read_export
from fdeplb.replay.report import ReplayReport

__all__ = ["ReplayError", "chain_of", "parse_lines", "read_export", "replay", "replay_file", "check_plans",
           "check_gates", "whatif", "rebuild", "ReplayReport"]
