"""The cluster's DeviceTaintRules as the planner applies them; `driver.taintrules` says which
devices a rule selects and why that is kube-scheduler's rule.

kube-scheduler adds each rule's taint to the devices the rule selects before its allocator
looks at them; the planner does the same when it reads a node's ResourceSlices into the model
(`controller.model.inventories_from_slices`), so a rule's taint is a device taint like the
node's own from there on: the engine skips devices whose taints a request does not tolerate,
and the refusal names the rule (`controller.tolerations.DeviceTaint.rule`).

A rule that is added, changed or deleted marks for re-reading only the nodes whose pools it may
select; the planner re-reads them before its next decision, as it does after a slice changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from controller.tolerations import EFFECTS, DeviceTaint
from driver.apiviews import ObjectView, SliceView
from driver.taintrules import TaintRule, parse_taint_rule

JsonView = Mapping[str, Any]  # an API object as read, never written back


class TaintRules:
    """The rules the informer delivered, by name; rules that select nothing are not kept."""

    def __init__(self, driver: str) -> None:
        self._driver = driver
        self._rules: dict[str, TaintRule] = {}
        # pool -> the rules that may select some device of it; emptied on every change.
        self._per_pool: dict[str, tuple[TaintRule, ...]] = {}

    def observe(
        self, obj: JsonView, slices_by_node: Mapping[str, Mapping[str, JsonView]]
    ) -> set[str]:
        """Take a rule as the informer delivered it; the nodes whose devices it changes."""
        name = ObjectView(obj).name
        rule = parse_taint_rule(obj)
        if rule is not None and rule.effect not in EFFECTS:
            rule = None  # an effect this version does not know is informational (the API says)
        old = self._rules.get(name)
        if rule == old:
            return set()  # e.g. kube-controller-manager wrote the rule's status
        if rule is None:
            del self._rules[name]
        else:
            self._rules[name] = rule
        return self._changed((old, rule), slices_by_node)

    def forget(
        self, obj: JsonView, slices_by_node: Mapping[str, Mapping[str, JsonView]]
    ) -> set[str]:
        """The rule is deleted; the nodes whose devices it tainted."""
        old = self._rules.pop(ObjectView(obj).name, None)
        return self._changed((old,), slices_by_node)

    def taints(self, pool: str, device: str) -> tuple[DeviceTaint, ...]:
        """The taints the rules add to one device of this driver, by rule name."""
        if not self._rules:
            return ()
        candidates = self._per_pool.get(pool)
        if candidates is None:
            candidates = tuple(
                sorted(
                    (r for r in self._rules.values() if r.may_select_pool(self._driver, pool)),
                    key=lambda r: r.name,
                )
            )
            self._per_pool[pool] = candidates
        return tuple(
            DeviceTaint(r.key, r.value, r.effect, r.name)
            for r in candidates
            if r.device is None or r.device == device
        )

    def _changed(
        self,
        rules: Iterable[TaintRule | None],
        slices_by_node: Mapping[str, Mapping[str, JsonView]],
    ) -> set[str]:
        changed = [r for r in rules if r is not None]
        if not changed:
            return set()
        self._per_pool.clear()
        return {
            node
            for node, slices in slices_by_node.items()
            if any(r.may_select_pool(self._driver, p) for r in changed for p in _pools(slices))
        }


def _pools(slices: Mapping[str, JsonView]) -> set[str]:
    out = set()
    for s in slices.values():
        pool = SliceView(s).pool_name
        if pool:
            out.add(pool)
    return out
