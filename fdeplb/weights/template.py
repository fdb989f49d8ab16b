"""Expert tensor names in a checkpoint: one template per model family, no paddle needed.

A template turns (MoE layer index, logical expert id, suffix) into the tensor name stored in the checkpoint, e.g.
``ernie.layers.3.mlp.experts.17.up_gate_proj.weight``. The MoE layer index is the row of ``phy2log`` (0..L-1);
models whose first layers are dense (ERNIE-4.5: ``moe_layer_start_index``, DeepSeek-V3: ``first_k_dense_replace``)
name their MoE layers with an offset, set by ``first_layer`` or by an explicit ``layer_ids`` list.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fdeplb.errors import InputError


@dataclass(frozen=True)
class ExpertTemplate:
    """How the tensors of one expert are named in a checkpoint.

    Attributes:
        pattern: format string with ``{layer}``, ``{expert}`` and ``{suffix}`` fields.
        suffixes: the per-expert tensor suffixes, in a fixed order (the order of ``LiveExperts.tensors`` keys and of
            the checksum fields).
        first_layer: checkpoint layer index of MoE layer 0 (ignored when ``layer_ids`` is given).
        layer_ids: checkpoint layer index of each MoE layer, for models whose MoE layers are not contiguous.

    Raises:
        InputError: a pattern without the three fields, no suffixes, duplicate suffixes, or a negative layer offset.
    """

    pattern: str
    suffixes: tuple[str, ...]
    first_layer: int = 0
    layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for field in ("{layer}", "{expert}", "{suffix}"):
            if field not in self.pattern:
                raise InputError(f"expert template {self.pattern!r} lacks the {field} field")
        suffixes = tuple(self.suffixes)
        if not suffixes or len(set(suffixes)) != len(suffixes):
            raise InputError(f"expert template needs distinct, non-empty suffixes, got {suffixes!r}")
        object.__setattr__(self, "suffixes", suffixes)
        if self.first_layer < 0:
            raise InputError(f"first_layer must be >= 0, got {self.first_layer}")
        if self.layer_ids is not None:
            object.__setattr__(self, "layer_ids", tuple(int(x) for x in self.layer_ids))

    def checkpoint_layer(self, layer: int) -> int:
        """Checkpoint layer index of MoE layer ``layer`` (the row of ``phy2log``).

        Raises:
            InputError: ``layer`` outside ``layer_ids`` when that list is given, or negative.
        """
        if layer < 0:
            raise InputError(f"MoE layer index must be >= 0, got {layer}")
        if self.layer_ids is not None:
            if layer >= len(self.layer_ids):
                raise InputError(f"MoE layer {layer} is outside the template's {len(self.layer_ids)} layer_ids")
            return self.layer_ids[layer]
        return self.first_layer + layer

    def name(self, layer: int, expert: int, suffix: str) -> str:
        """Checkpoint tensor name of ``suffix`` of logical expert ``expert`` in MoE layer ``layer``."""
        return self.pattern.format(layer=self.checkpoint_layer(layer), expert=int(expert), suffix=suffix)

    def names(self, layer: int, expert: int) -> dict[str, str]:
        """``suffix -> tensor name`` for every suffix of one expert, in template order."""
        return {s: self.name(layer, expert, s) for s in self.suffixes}

    def with_layers(self, *, first_layer: int | None = None, layer_ids: tuple[int, ...] | None = None) -> ExpertTemplate:
        """A copy with another MoE-layer offset (``first_layer``) or explicit ``layer_ids``."""
        return replace(
            self,
            first_layer=self.first_layer if first_layer is None else first_layer,
            layer_ids=layer_ids if layer_ids is not None else self.layer_ids,
        )


_ERNIE = "ernie.layers.{layer}.mlp.experts.{expert}.{suffix}"
_GENERIC = "model.layers.{layer}.mlp.experts.{expert}.{suffix}"

#: Named templates. ``ernie``: FastDeploy/ERNIE-4.5 unquantised experts; ``ernie-quant``: their quantised variant
#: (FastDeploy's ``quant_weight`` + ``weight_scale`` per projection); ``generic``: HF-style names used by DeepSeek,
#: Qwen-MoE and others (``gate_proj`` / ``up_proj`` / ``down_proj``).
PRESETS: dict[str, ExpertTemplate] = {
    "ernie": ExpertTemplate(_ERNIE, ("up_gate_proj.weight", "down_proj.weight")),
    "ernie-quant": ExpertTemplate(
        _ERNIE,
        (
            "up_gate_proj.quant_weight",
            "up_gate_proj.weight_scale",
            "down_proj.quant_weight",
            "down_proj.weight_scale",
        ),
    ),
    "generic": ExpertTemplate(_GENERIC, ("gate_proj.weight", "up_proj.weight", "down_proj.weight")),
}


def resolve_template(preset: str | None = None, template: ExpertTemplate | None = None) -> ExpertTemplate:
    """The template given explicitly, else the named preset (``"ernie"`` when neither is given).

    Raises:
        InputError: both given, or an unknown preset name.
    """
    if template is not None:
        if preset is not None:
            raise InputError("give either a preset name or a template, not both")
        return template
    name = "ernie" if preset is None else preset
    if name not in PRESETS:
        raise InputError(f"unknown expert template preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]
