"""MIG-aware preemption: when a pod fits nowhere, evict the cheapest set of lower-priority pods
whose slices combine into a placement for it, and hold those slices for it.

- `search`: the pure victim search (cheapest set by count, priority, work lost), given a
  feasibility oracle;
- `preemptor`: the reconciler's `PreemptionHook`: candidates from the stores, the oracle on the
  engine's model (`EnginePlanner.placement_without`), the dry run, the evictions, the events;
- `eviction`: the Eviction API and PodDisruptionBudgets.

The hold itself (freed slices kept for the preemptor) lives in the planner's model
(`controller.planner`), where every placement sees it. docs/preemption.md tells the story.
"""
