"""The config editor: ipywidgets generated from LabConfig's JSON schema, one tab per section.

Each field gets a typed input (checkbox, number, dropdown for choices, text for optional and
list values, parsed as YAML), its help text and when a change takes effect on a line under it,
and inline validation. Edits go through `LabConfig.update`, the path every edit takes: a value the
config (or a loaded Lab) refuses shows its one-line reason right under its field and changes
nothing; the typed value stays in view until it is corrected or reverted. Labels and tabs are
never cut (sized to the longest name, wrapping as a last resort). Once the Lab is loaded,
load-time fields are read-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import yaml

from ..config.fields import WHEN
from ..config.loading import load_config, save_config
from ..config.schema import LabConfig, field_when
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
    """How an optional or list value shows in its text input: a plain literal that YAML reads back (null for None,
    lists in flow style); never a YAML document (safe_dump ends a scalar with '...', which a user cannot edit)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return yaml.safe_dump(value, default_flow_style=True).strip()


def label_width(names) -> str:
    """The label column: the longest field name in `ch` (a digit's width, no narrower than the label font's average
    letter) plus room, so no name is cut; CSS wraps a label as a last resort (EDITOR_CSS)."""
    return f"{max(map(len, names)) + 2}ch"


# why a style element: ipywidgets gives tabs a fixed width (titles cut to "placen") with a rule of its own that a
# class-and-element rule loses to (so each rule below names the widget classes it overrides), HTML widgets a 28 px
# line height (a wrapped reason spread over 5 lines), and labels no wrapping; colours are JupyterLab's theme variables
EDITOR_CSS = """<style>
.grpo-lab-editor .jupyter-widgets.jupyter-widget-tab > .lm-TabBar { height: auto; min-height: 0; overflow: visible; }
.grpo-lab-editor .jupyter-widgets.jupyter-widget-tab > .lm-TabBar .lm-TabBar-content { flex-wrap: wrap; }
.grpo-lab-editor .jupyter-widgets.jupyter-widget-tab > .lm-TabBar .lm-TabBar-tab {
  flex: 0 0 auto; min-width: max-content; max-width: none; }
.grpo-lab-editor .widget-label { white-space: normal; overflow-wrap: anywhere; height: auto; }
.grpo-lab-editor .widget-html-content { line-height: 1.35; white-space: normal; }
.grpo-lab-editor .grpo-lab-field-error .widget-html-content { color: var(--jp-error-color1, #c00); font-size: 12px; }
.grpo-lab-editor .grpo-lab-help { color: var(--jp-ui-font-color2, #555); font-size: 11px; line-height: 1.3; }
.grpo-lab-editor .grpo-lab-legend { color: var(--jp-ui-font-color1, #222); font-size: 12px; }
</style>"""


def field_widget(name: str, prop: dict, value, label: str = "190px"):
    """The input for one schema property; returns (widget, parse) where parse(widget.value) -> the value handed to
    the config's validation. Numbers are typed as text and parsed by that validation, never by the widget. Why:
    ipywidgets' IntText dropped the '.' of '2.5' (the config took 25) and swallowed 'abc' without a word."""
    w = _widgets()
    when = prop.get("when", "live")
    tip = f"{prop.get('description', '')} [{when}: {WHEN[when]}]"
    # why 100% up to a cap: the field sizes to the editor's width (a fixed width overflowed a narrow notebook)
    layout = w.Layout(width="100%", max_width=f"calc({label} + 320px)")
    common = dict(description=name, tooltip=tip, style={"description_width": label}, layout=layout)
    common["continuous_update"] = False  # why: a half-typed value ('4.', '') is refused; apply on Enter or blur
    kind = FIELD_KINDS.get(prop.get("type"), "yaml") if "enum" not in prop else "choice"
    return FIELD_INPUTS[kind](w, value, prop, common)


def _choice(w, value, prop, common):
    return w.Dropdown(options=prop["enum"], value=value, **_no_update(common)), lambda v: v


def _checkbox(w, value, prop, common):
    return w.Checkbox(value=bool(value), indent=False, **_no_update(common)), bool


def _number(w, value, prop, common):
    return w.Text(value=as_text(value), **common), lambda v: v.strip() if isinstance(v, str) else v


def _text(w, value, prop, common):
    return w.Text(value=value, **common), str


def _yaml(w, value, prop, common):
    """Optional values, unions and lists: YAML text, "" or "null" = null."""
    return w.Text(
        value=as_text(value), placeholder="null", **common
    ), lambda v: yaml.safe_load(v) if v.strip() else None


FIELD_KINDS = {"boolean": "checkbox", "integer": "number", "number": "number", "string": "text"}
FIELD_INPUTS = {"choice": _choice, "checkbox": _checkbox, "number": _number, "text": _text, "yaml": _yaml}


def _no_update(common: dict) -> dict:
    return {k: v for k, v in common.items() if k != "continuous_update"}  # (a choice applies at once)


def help_line(prop: dict, label: str = "190px"):
    """The field's help and when an edit takes effect, as a line under it (tooltips are unreliable in ipywidgets 8)."""
    import html

    w = _widgets()
    when = prop.get("when", "live")
    text = html.escape(f"{prop.get('description', '')} [{when}: {WHEN[when]}]", quote=False)
    line = w.HTML(value=text, layout=w.Layout(width="auto", margin=f"-2px 0 6px calc({label} + 4px)"))
    line.add_class("grpo-lab-help")
    return line


class FieldError:
    """A refused value's one-line reason, right under its field, with a button that puts the config's value back;
    hidden while the field holds what the config holds."""

    def __init__(self, label: str, revert: Callable[[], None]):
        w = _widgets()
        self.text = w.HTML(value="", layout=w.Layout(flex="1 1 auto", min_width="0"))
        self.text.add_class("grpo-lab-field-error")
        button = w.Button(
            description="revert",
            layout=w.Layout(width="auto", flex="0 0 auto"),
            tooltip="show the config's value again",
        )
        button.on_click(lambda _: revert())
        # why from the field's left edge, not under its input: the reason gets the row's width (at most 2 lines)
        self.widget = w.HBox([self.text, button], layout=w.Layout(margin="0 0 4px 0", width="100%"))
        self.show(None)

    def show(self, reason: Optional[str]) -> None:
        import html

        self.reason = reason
        self.text.value = "" if reason is None else html.escape(reason, quote=False)
        self.widget.layout.display = "none" if reason is None else "flex"


LEGEND = (
    "<small>Edits apply to the Lab's config at once: <b>live</b> fields at the next phase that reads them, "
    "<b>rebuild</b> fields rebuild their part now; <b>load-time</b> fields are read-only once the Lab is loaded "
    "(make a new Lab to change them). Text fields apply on Enter or when they lose focus.</small>"
)


class ConfigEditor:
    def __init__(
        self,
        config: LabConfig,
        on_change: Optional[Callable[[LabConfig], None]] = None,
        loaded: Callable[[], bool] = lambda: False,
    ):
        """Edits `config` in place (a Lab's config: `lab.config`); `loaded()` says whether its Lab is loaded;
        `on_change(config)` is called after every applied edit."""
        w = _widgets()
        self.config, self.on_change, self.loaded = config, on_change, loaded
        self.inputs: dict[tuple[str, str], tuple] = {}
        self.help: dict[tuple[str, str], object] = {}  # the line under each field: its help and when it applies
        self.errors: dict[tuple[str, str], FieldError] = {}  # a refused value's reason, under its field
        self.message = w.HTML(value="")
        schema = LabConfig.model_json_schema()
        defs, data = schema["$defs"], config.to_dict()
        label = label_width(n for prop in schema["properties"].values() for n in _resolve(prop, defs)["properties"])
        tabs = []
        for section, prop in schema["properties"].items():
            fields = _resolve(prop, defs)["properties"]
            rows = []
            for name, fprop in fields.items():
                widget, parse = field_widget(name, fprop, data[section][name], label)
                widget.observe(self._changed(section, name), names="value")
                self.inputs[(section, name)] = (widget, parse)
                self.errors[(section, name)] = FieldError(label, self._revert(section, name))
                self.help[(section, name)] = help_line(fprop, label)
                rows += [widget, self.errors[(section, name)].widget, self.help[(section, name)]]
            tabs.append(w.VBox(rows))
        self.tabs = w.Tab(children=tabs)
        for i, section in enumerate(schema["properties"]):
            self.tabs.set_title(i, section)
        self.path = w.Text(value="config.yaml", description="YAML", layout=w.Layout(width="300px"))
        load, save = w.Button(description="load"), w.Button(description="save")
        load.on_click(lambda _: self.load(self.path.value))
        save.on_click(lambda _: self.save(self.path.value))
        self.legend = w.HTML(value=LEGEND)
        self.legend.add_class("grpo-lab-legend")
        style = w.HTML(value=EDITOR_CSS, layout=w.Layout(display="none"))
        self.widget = w.VBox(
            [style, self.tabs, self.message, self.legend, w.HBox([self.path, load, save])],
            layout=w.Layout(flex="1 1 420px", min_width="0"),  # why: it takes the width the notebook has
        )
        self.widget.add_class("grpo-lab-editor")
        self._syncing = False
        self.lock_load_time()

    def lock_load_time(self) -> None:
        """Load-time fields are read-only once the Lab is loaded (and editable again before)."""
        locked = self.loaded()
        for (section, name), (widget, _) in self.inputs.items():
            widget.disabled = locked and field_when(f"{section}.{name}") == "load"

    def _changed(self, section: str, name: str):
        def handler(change):
            if not self._syncing:
                self.set(section, name, change["new"])

        return handler

    def set(self, section: str, name: str, raw) -> bool:
        """Apply one edit through the config's update (validated, guarded when loaded), else show why under the
        field, keeping the typed value in view (the config keeps its own). Returns whether applied."""
        _, parse = self.inputs[(section, name)]
        path = f"{section}.{name}"
        try:
            changed = self.config.update({path: parse(raw)})
        except (LabError, yaml.YAMLError, ValueError, TypeError) as err:
            keeps = as_text(self.config.to_dict()[section][name])
            self.errors[(section, name)].show(f"{str(err).strip()} (not applied; stays {keeps})")
            self.message.value = ""
            return False
        self.errors[(section, name)].show(None)
        when = field_when(path)
        self.message.value = f"{path}: {WHEN[when]}" if changed else ""
        self.refresh()
        if self.on_change:
            self.on_change(self.config)
        return True

    def _error(self, err) -> None:
        import html

        self.message.value = (
            f"<span style='color:var(--jp-error-color1, #c00)'>{html.escape(str(err), quote=False)}</span>"
        )

    def _revert(self, section: str, name: str) -> Callable[[], None]:
        def revert():
            self.errors[(section, name)].show(None)
            self.refresh()

        return revert

    def refresh(self) -> None:
        """Show the current config in every input but one whose refused value waits to be corrected or reverted
        (and lock load-time inputs if the Lab was loaded since)."""
        self.lock_load_time()
        data = self.config.to_dict()
        self._syncing = True
        try:
            for (section, name), (widget, _) in self.inputs.items():
                if self.errors[(section, name)].reason is not None:
                    continue
                value = data[section][name]
                if isinstance(widget.value, str) and not isinstance(value, str):
                    value = as_text(value)
                widget.value = value
        finally:
            self._syncing = False

    def load(self, path: str) -> None:
        """Apply a YAML file's values, all at once (a loaded Lab refuses a file whose load-time fields differ)."""
        try:
            self.config.assign(load_config(Path(path)))
        except LabError as err:
            self._error(err)
            return
        self.refresh()
        self.message.value = f"loaded {path}"
        if self.on_change:
            self.on_change(self.config)

    def save(self, path: str) -> None:
        save_config(self.config, path)
        self.message.value = f"saved {path}"
