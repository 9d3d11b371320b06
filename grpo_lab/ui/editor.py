"""The config editor: ipywidgets generated from LabConfig's JSON schema, one tab per section.

Each field gets a typed input (checkbox, number, dropdown for choices, text for optional and
list values, parsed as YAML), its help text as the tooltip, and inline validation: a value the
config rejects shows the one-line error under the tabs and leaves the config unchanged.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Optional

import yaml

from ..config import LabConfig, load_config, save_config
from ..errors import LabError


def _widgets():
    try:
        import ipywidgets as w
    except ImportError:
        raise LabError("the widget editor needs ipywidgets; install grpo-lab[notebook]") from None
    return w


def _resolve(prop: dict, defs: dict) -> dict:
    if "$ref" in prop:
        return defs[prop["$ref"].split("/")[-1]]
    return prop


def as_text(value) -> str:
    """How an optional or list value shows in its text input (YAML; null for None)."""
    return "null" if value is None else yaml.safe_dump(value, default_flow_style=True).strip()


def field_widget(name: str, prop: dict, value):
    """The input for one schema property; returns (widget, parse) where parse(widget.value) -> config value."""
    w = _widgets()
    kind, tip = prop.get("type"), prop.get("description", "")
    common = dict(description=name, tooltip=tip, style={"description_width": "190px"},
                  layout=w.Layout(width="460px"))
    if "enum" in prop:
        return w.Dropdown(options=prop["enum"], value=value, **common), lambda v: v
    if kind == "boolean":
        return w.Checkbox(value=bool(value), indent=False, **common), bool
    if kind == "integer":
        return w.IntText(value=value, **common), int
    if kind == "number":
        return w.FloatText(value=value, **common), float
    if kind == "string":
        return w.Text(value=value, **common), str
    # optional values, unions and lists: YAML text, "" or "null" = null
    return w.Text(value=as_text(value), placeholder="null", **common), lambda v: yaml.safe_load(v) if v.strip() else None


class ConfigEditor:
    def __init__(self, config: LabConfig, on_change: Optional[Callable[[LabConfig], None]] = None):
        w = _widgets()
        self.config, self.on_change = config, on_change
        self.inputs: dict[tuple[str, str], tuple] = {}
        self.message = w.HTML(value="")
        schema = LabConfig.model_json_schema()
        defs, data = schema["$defs"], config.to_dict()
        tabs = []
        for section, prop in schema["properties"].items():
            fields = _resolve(prop, defs)["properties"]
            rows = []
            for name, fprop in fields.items():
                widget, parse = field_widget(name, fprop, data[section][name])
                widget.observe(self._changed(section, name), names="value")
                self.inputs[(section, name)] = (widget, parse)
                rows.append(widget)
            tabs.append(w.VBox(rows))
        self.tabs = w.Tab(children=tabs)
        for i, section in enumerate(schema["properties"]):
            self.tabs.set_title(i, section)
        self.path = w.Text(value="config.yaml", description="YAML", layout=w.Layout(width="300px"))
        load, save = w.Button(description="load"), w.Button(description="save")
        load.on_click(lambda _: self.load(self.path.value))
        save.on_click(lambda _: self.save(self.path.value))
        self.widget = w.VBox([self.tabs, self.message, w.HBox([self.path, load, save])])
        self.widget.add_class("grpo-lab-editor")
        self._syncing = False

    def _changed(self, section: str, name: str):
        def handler(change):
            if not self._syncing:
                self.set(section, name, change["new"])
        return handler

    def set(self, section: str, name: str, raw) -> bool:
        """Validate one edit; apply it to the config if valid, else show why. Returns whether applied."""
        widget, parse = self.inputs[(section, name)]
        data = copy.deepcopy(self.config.to_dict())
        try:
            data[section][name] = parse(raw)
            config = load_config(data)
        except (LabError, yaml.YAMLError, ValueError, TypeError) as err:
            self.message.value = f"<span style='color:#c00'>{err}</span>"
            return False
        self.message.value = ""
        self.config = config
        if self.on_change:
            self.on_change(config)
        return True

    def refresh(self) -> None:
        """Show the current config in every input."""
        data = self.config.to_dict()
        self._syncing = True
        try:
            for (section, name), (widget, _) in self.inputs.items():
                value = data[section][name]
                if isinstance(widget.value, str) and not isinstance(value, str):
                    value = as_text(value)
                widget.value = value
        finally:
            self._syncing = False

    def load(self, path: str) -> None:
        try:
            self.config = load_config(Path(path))
        except LabError as err:
            self.message.value = f"<span style='color:#c00'>{err}</span>"
            return
        self.refresh()
        self.message.value = f"loaded {path}"
        if self.on_change:
            self.on_change(self.config)

    def save(self, path: str) -> None:
        save_config(self.config, path)
        self.message.value = f"saved {path}"
