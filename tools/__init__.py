"""Tools that models call from environments (plain `@tool` functions)."""
