"""Plans: the versioned JSON plan, its schema check, and how it is shown to people."""
