"""Sub-commands of the `meshplan` CLI that need the runtime (each module has `register(subparsers)`)."""
