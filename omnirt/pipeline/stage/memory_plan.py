"""The memory plan: how many KV slots each stage gets, from its device's memory.

`gpu_memory_utilization` is a fraction of the device's total memory, as in vLLM: per stage (that
stage's weights, KV caches and graphs/workspace), or at the top level (everything of the stages loaded
in this process that set no fraction of their own). Within a budget, what the weights and the
graphs/workspace leave goes to the KV caches: at least `max_num_seqs` slots of `max_model_len` tokens
each (else start-up fails naming the key and the numbers), and where prefix caching makes more slots
pay (resident prefixes, `omnirt/pipeline/stage/prefix_cache.py`), as many more as fit, up to `MAX_SLOTS_PER_SEQ`
x `max_num_seqs`; stages sharing a budget grow by the same factor. A stage under no fraction gets
exactly `max_num_seqs` slots. Every plan must also fit the memory free on the device once the weights
are loaded (another process may hold some). Numbers in, numbers out: no torch here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omnirt.pipeline.config import ProfileError

log = logging.getLogger("omnirt.memory")  # at INFO in replica workers too, whose other loggers warn only
GIB = 2**30
MAX_SLOTS_PER_SEQ = 4  # resident prefixes beyond this rarely pay; the rest of the budget stays headroom


@dataclass(slots=True, frozen=True)
class StageMemory:
    """What one stage loaded here costs, and what one KV slot of it costs."""

    name: str
    stage_id: int
    max_num_seqs: int
    max_model_len: int
    weight_bytes: int
    workspace_bytes: int  # its largest step's activations and its graphs (an estimate: sized before capture)
    slot_bytes: int = 0  # one slot of the caches sized by slots (0: no KV cache)
    fixed_kv_bytes: int = 0  # cache sized by the batch, not the slots (the Talker's code predictor)
    fraction: float | None = None  # its own gpu_memory_utilization
    can_grow: bool = False  # slots beyond max_num_seqs pay (prefix caching)

    def kv_bytes(self, num_slots: int) -> int:
        """With the scratch slot every slot cache has (`SlotKVCache.scratch_slot`)."""
        return (num_slots + 1) * self.slot_bytes + self.fixed_kv_bytes if self.slot_bytes else self.fixed_kv_bytes

    @property
    def min_num_slots(self) -> int:
        return self.max_num_seqs if self.slot_bytes else 0

    @property
    def key(self) -> str:
        return f"stages[{self.stage_id}].gpu_memory_utilization"


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    device: str
    total_bytes: int
    free_bytes: int  # free once the weights are loaded
    stages: tuple[StageMemory, ...]
    num_slots: dict[str, int]
    fraction: float | None = None  # the global one

    def kv_bytes(self, name: str) -> int:
        stage = next(s for s in self.stages if s.name == name)
        return stage.kv_bytes(self.num_slots[name])

    @property
    def new_bytes(self) -> int:
        """What the plan allocates after the weights: the KV caches and the graphs/workspace."""
        return sum(self.kv_bytes(s.name) + s.workspace_bytes for s in self.stages)

    @property
    def headroom_bytes(self) -> int:
        return self.free_bytes - self.new_bytes

    def lines(self) -> list[str]:
        """The plan as start-up logs it."""
        weights = sum(s.weight_bytes for s in self.stages)
        other = self.total_bytes - self.free_bytes - weights
        budget = "" if self.fraction is None else \
            f", gpu_memory_utilization {self.fraction} = {_size(self.fraction * self.total_bytes)}"
        out = [f"memory plan on {self.device}: {_size(self.total_bytes)} total{budget}; weights {_size(weights)}, "
               f"{_size(max(other, 0))} held otherwise (runtime, other processes), {_size(self.free_bytes)} free"]
        for s in self.stages:
            own = "" if s.fraction is None else f" (its gpu_memory_utilization {s.fraction})"
            kv = "no KV cache" if not s.slot_bytes else \
                f"KV {self.num_slots[s.name]} slots x {s.max_model_len} tokens = {_size(self.kv_bytes(s.name))}"
            out.append(f"  {s.name:<8} weights {_size(s.weight_bytes)}, {kv}, graphs/workspace "
                       f"{_size(s.workspace_bytes)} (estimated){own}")
        out.append(f"  headroom {_size(self.headroom_bytes)} free once KV caches and graphs/workspace are in place")
        return out


def plan_memory(stages: list[StageMemory], free_bytes: int, total_bytes: int, fraction: float | None,
                device: str) -> MemoryPlan:
    """The KV slots of each stage; ProfileError naming the key and the numbers when they cannot fit."""
    num_slots = {s.name: s.min_num_slots for s in stages}
    own = [s for s in stages if s.fraction is not None]
    for s in own:
        num_slots |= _fit([s], int(s.fraction * total_bytes), s.key, device, total_bytes)
    shared = [s for s in stages if s.fraction is None]
    if fraction is not None and shared:
        budget = int(fraction * total_bytes) - sum(int(s.fraction * total_bytes) for s in own)
        num_slots |= _fit(shared, budget, "gpu_memory_utilization", device, total_bytes)
    plan = MemoryPlan(device, total_bytes, free_bytes, tuple(stages), num_slots, fraction)
    _check_free(plan)
    return plan


def _fit(group: list[StageMemory], budget: int, key: str, device: str, total: int) -> dict[str, int]:
    """Slots for the stages sharing `budget`: max_num_seqs each, and the growers' equal share of the rest."""
    room = budget - sum(s.weight_bytes + s.workspace_bytes for s in group)
    need = sum(s.kv_bytes(s.min_num_slots) for s in group)
    if room < need:
        raise ProfileError(_short(group, budget, room, need, key, device, total), key, "memory plan")
    growers = [s for s in group if s.can_grow and s.slot_bytes]
    out = {s.name: s.min_num_slots for s in group}
    per_step = sum((s.max_num_seqs + 1) * s.slot_bytes for s in growers)
    if per_step:
        fixed = sum(s.kv_bytes(s.min_num_slots) for s in group if s not in growers)
        spare = room - fixed - sum(s.fixed_kv_bytes for s in growers)  # for the growers' slots, in whole bytes
        for s in growers:
            out[s.name] = min(spare * (s.max_num_seqs + 1) // per_step - 1, MAX_SLOTS_PER_SEQ * s.max_num_seqs)
    return out


def _short(group: list[StageMemory], budget: int, room: int, need: int, key: str, device: str,
           total: int) -> str:
    names = " + ".join(s.name for s in group)
    each = "; ".join(f"{s.name} {s.max_num_seqs} x {s.max_model_len} tokens {_size(s.kv_bytes(s.min_num_slots))}"
                     for s in group if s.slot_bytes)
    weights, work = sum(s.weight_bytes for s in group), sum(s.workspace_bytes for s in group)
    return (f"{key} gives {names} {_size(budget)} of the {_size(total)} on {device}: weights {_size(weights)} and "
            f"graphs/workspace {_size(work)} leave {_size(room)} for the KV cache, but max_num_seqs x max_model_len "
            f"needs {_size(need)} ({each}); raise {key} or lower max_num_seqs or max_model_len")


def _check_free(plan: MemoryPlan) -> None:
    """The plan's allocations must fit what the device has free now."""
    if plan.new_bytes <= plan.free_bytes:
        return
    sized = [s for s in plan.stages if s.fraction is not None]
    if plan.fraction is not None and len(sized) < len(plan.stages):
        key = "gpu_memory_utilization"
    elif sized:
        key = sized[0].key
    else:
        biggest = max(plan.stages, key=lambda s: plan.kv_bytes(s.name))
        key = f"stages[{biggest.stage_id}].max_num_seqs"
    kv = sum(plan.kv_bytes(s.name) for s in plan.stages)
    hint = f"lower {key} or free the device" if key.endswith("gpu_memory_utilization") else \
        "lower max_num_seqs or max_model_len"
    raise ProfileError(f"{key}: the plan needs {_size(plan.new_bytes)} beyond the weights (KV {_size(kv)}, "
                       f"graphs/workspace {_size(plan.new_bytes - kv)}) but {plan.device} has {_size(plan.free_bytes)} "
                       f"free of {_size(plan.total_bytes)}; {hint}", key, "memory plan")


def log_plan(plan: MemoryPlan) -> None:
    for line in plan.lines():
        log.info("%s", line)


def log_capture(plan: MemoryPlan, free_before: int, free_after: int) -> None:
    """What capturing the graphs (and warming their steps up) took, against the plan's estimate; a warning
    when it took more, since the headroom is then smaller than the plan says."""
    taken, estimate = free_before - free_after, sum(s.workspace_bytes for s in plan.stages)
    log.info("graphs captured on %s: %s measured (%s estimated for graphs/workspace); %s free now", plan.device,
             _size(taken), _size(estimate), _size(free_after))
    if taken > estimate:
        log.warning("graph capture alone took %s more than the plan's graphs/workspace estimate: less than the "
                    "planned %s of headroom is left (lower gpu_memory_utilization to keep more)",
                    _size(taken - estimate), _size(plan.headroom_bytes))


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"
