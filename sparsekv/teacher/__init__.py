"""What the head learns from: the frozen model's own attention statistics (`statistics`), the
instrumented forward that yields them (`forward`), the reconstruction (repeat-pass) targets
(`reconstruction`) and the ranking losses (`losses`)."""
