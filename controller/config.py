"""How one installation's controller decides: the settings every part of the reconciler reads.

Frozen and built once by `controller.main` from the flags (tests build it directly), so no
part of the controller can change another part's idea of the driver, gate or timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.objects import CarveClasses
from driver.contract import DEFAULT_CONTRACT, Contract


@dataclass(frozen=True)
class ReconcilerConfig:
    """The controller's settings; the defaults are the flags' defaults."""

    contract: Contract = DEFAULT_CONTRACT
    classes: CarveClasses = field(default=None)  # type: ignore[assignment]  # from contract
    native_fallback_after: float | None = None
    retry_interval: float = 30.0
    max_replans: int = 3
    claims_grace: float = 30.0
    event_interval: float = 300.0
    node_loss_grace: float | None = 300.0  # NotReady this long = lost; None/0: signal off
    # Carve before bind (controller.nodehealth.carvewait): keep the gate until the node carved.
    hold_gate_until_carved: bool = True
    carve_wait: float = 30.0
    # A placement waits up to this long for release writes in flight beside the decision
    # thread: the space they free (and the warm slice the node kept there) is the best fit.
    release_wait: float = 0.5
    # Visits per placement pass: the rest stay due for the next pass, which first applies
    # what arrived meanwhile, so a new pod does not wait behind a pass over a whole backlog.
    visits_per_pass: int = 256

    def __post_init__(self) -> None:
        if self.classes is None:
            object.__setattr__(self, "classes", CarveClasses.of(self.contract))

    @property
    def driver(self) -> str:
        return self.contract.driver

    @property
    def gate(self) -> str:
        return self.contract.scheduling_gate

    @property
    def finalizer(self) -> str:
        return self.contract.allocation_finalizer
