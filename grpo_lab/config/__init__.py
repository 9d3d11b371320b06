"""The one typed config (schema.py), its fields' building blocks (fields.py), loading and saving it (loading.py), the
presets shipped with the package, and edits on a loaded Lab (edits.py)."""
