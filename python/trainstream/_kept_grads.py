"""Which gradients torch would still hold in `p.grad` from the steps before, where a wrapped model's have
left for the daemon during backward.

torch's AdamW updates every parameter whose `p.grad` is a tensor: after `zero_grad(set_to_none=False)`
that includes parameters the step's backward passes did not reach (a zero gradient: their moments decay,
weight decay applies). The Rank (_rank.py) tells this object what happens and asks it at each step's
first backward which parameters to send a zero gradient for.

A loop that never zeroes, or zeroes by hand (`p.grad = None`), has each step's gradients start from
none, as wrap's contract has always said (optimizer.step() empties p.grad): the same as torch for the
second, where torch would add them to the last step's for the first (docs/porting.md, "Not caught yet";
the examples and tests written for trainstream rely on it).

Invariant: `kept` holds the parameters whose `p.grad` torch would hold as a tensor now, a loop that
zeroes at every step assumed, and `holds(i)` says whether torch holds one for parameter i now (a wrapped
parameter's `p.grad` is refused there, _watched.py).
"""


class KeptGradients:
    def __init__(self):
        self.kept: set[int] = set()
        self.zeroed = True  # zero_grad() since the last step
        self.live = False  # torch holds the kept gradients now: a backward since the step, or zeroed to zeros

    def got(self, i: int) -> None:
        """Parameter i received a gradient in a backward pass."""
        self.kept.add(i)
        self.live = True

    def zero_grad(self, set_to_none: bool) -> None:
        self.zeroed = True
        if set_to_none:
            self.kept.clear()
        self.live = bool(self.kept)

    def stepped(self) -> None:
        self.zeroed = False
        self.live = False  # optimizer.step() empties p.grad (wrap's contract)

    def holds(self, i: int) -> bool:
        """Whether torch would hold a gradient tensor in parameter i's p.grad now."""
        return self.live and i in self.kept

    def to_zero_fill(self) -> set[int]:
        """At a step's first backward pass: the parameters whose gradient torch sums into a zero `p.grad`
        (those without one in the step's backward passes are updated with a zero gradient)."""
        if not self.zeroed:  # no zero_grad() since the step, which emptied p.grad (wrap's contract)
            self.kept.clear()
        return set(self.kept)
