"""What GPU nodes tell the controller about themselves, and what it does about it.

- `signals`: when a node counts as lost (deleted, out-of-service, NotReady past a grace);
- `carvewait`: carve before bind, whether a node has carved a claim's devices, failed to, or
  said nothing yet (the binding conditions it reports).

Both are pure verdicts over API objects. docs/controller.md ("Lost nodes", "Carve before
bind") tells the story.
"""
