"""kvscope's widgets: one per file."""
