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
from .field_help import help_html, on_the_cpu


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
.grpo-lab-editor .grpo-lab-page > * { flex-shrink: 0; }
.grpo-lab-editor .grpo-lab-help details > summary { cursor: pointer; }
.grpo-lab-editor .grpo-lab-badge { display: inline-block; font-size: 10px; line-height: 1.2; padding: 0 4px;
  margin-right: 4px; border-radius: 3px; border: 1px solid var(--jp-border-color1, #999); }
.grpo-lab-editor .grpo-lab-badge-rebuild { border-color: var(--jp-warn-color1, #f0ad4e); }
.grpo-lab-editor .grpo-lab-badge-load { border-color: var(--jp-brand-color1, #1976d2); }
.grpo-lab-editor .grpo-lab-badge-cuda { border-style: dashed; }
.grpo-lab-editor .grpo-lab-ok { color: var(--jp-success-color1, #2e7d32); font-weight: 600; margin-left: 6px; }
.grpo-lab-editor .grpo-lab-refused input, .grpo-lab-editor .grpo-lab-refused select {
  border-color: var(--jp-error-color1, #c00) !important; box-shadow: 0 0 0 1px var(--jp-error-color1, #c00); }
.grpo-lab-editor .grpo-lab-applied input, .grpo-lab-editor .grpo-lab-applied select {
  border-color: var(--jp-success-color1, #2e7d32) !important; }
</style>"""


EDITOR_HEIGHT = "300px"  # each tab's page: about 8 fields with their help lines, the rest one scroll away


class Looks:
    """The layouts and styles all the fields of one editor share: one widget model each, not one per field (a model is
    a comm in the kernel and an entry in a saved notebook's widget state; made per field, they came to 1,000)."""

    def __init__(self, label: str):
        w = _widgets()
        # why 100% up to a cap: the field sizes to the editor's width (a fixed width overflowed a narrow notebook)
        self.input = w.Layout(width="100%", max_width=f"calc({label} + 320px)")
        self.help = w.Layout(width="auto", margin=f"-2px 0 6px calc({label} + 4px)")
        self.html = style_of(w.HTML)
        self.styles = {cls.__name__: style_of(cls, label) for cls in (w.Text, w.Dropdown, w.Checkbox)}


def style_of(widget_class, label: Optional[str] = None):
    """A style `widget_class` takes (each has its own style class; ipywidgets exports only some of them)."""
    kind = widget_class.class_traits()["style"].klass
    return kind() if label is None else kind(description_width=label)


def field_widget(name: str, prop: dict, value, looks: Looks):
    """The input for one schema property; returns (widget, parse) where parse(widget.value) -> the value handed to
    the config's validation. Numbers are typed as text and parsed by that validation, never by the widget. Why:
    ipywidgets' IntText dropped the '.' of '2.5' (the config took 25) and swallowed 'abc' without a word."""
    w = _widgets()
    when = prop.get("when", "live")
    tip = f"{prop.get('description', '')} [{when}: {WHEN[when]}]"
    common = dict(description=name, tooltip=tip, layout=looks.input)
    kind = FIELD_KINDS.get(prop.get("type"), "yaml") if "enum" not in prop else "choice"
    return FIELD_INPUTS[kind](w, value, prop, common, looks.styles)


def _choice(w, value, prop, common, styles):  # (a choice applies at once)
    return w.Dropdown(options=prop["enum"], value=value, style=styles["Dropdown"], **common), lambda v: v


def _checkbox(w, value, prop, common, styles):
    return w.Checkbox(value=bool(value), indent=False, style=styles["Checkbox"], **common), bool


def _typed(w, value, common, styles, **extra):
    # why continuous_update off: a half-typed value ('4.', '') is refused; apply on Enter or blur
    return w.Text(value=value, continuous_update=False, style=styles["Text"], **common, **extra)


def _number(w, value, prop, common, styles):
    return _typed(w, as_text(value), common, styles), lambda v: v.strip() if isinstance(v, str) else v


def _text(w, value, prop, common, styles):
    return _typed(w, value, common, styles), str


def _yaml(w, value, prop, common, styles):
    """Optional values, unions and lists: YAML text, "" or "null" = null."""
    widget = _typed(w, as_text(value), common, styles, placeholder="null")
    return widget, lambda v: yaml.safe_load(v) if v.strip() else None


FIELD_KINDS = {"boolean": "checkbox", "integer": "number", "number": "number", "string": "text"}
FIELD_INPUTS = {"choice": _choice, "checkbox": _checkbox, "number": _number, "text": _text, "yaml": _yaml}


def help_line(prop: dict, looks: Looks, cuda: bool = False):
    """The field's badge and help as a line under it (tooltips are unreliable in ipywidgets 8); the tooltip keeps the
    whole help and when an edit applies."""
    w = _widgets()
    line = w.HTML(value=help_html(prop, cuda=cuda), layout=looks.help, style=looks.html)
    line.add_class("grpo-lab-help")
    return line


class FieldError:
    """A refused value's one-line reason, right under its field, with a button that puts the config's value back;
    hidden while the field holds what the config holds. Its widgets are made when a value is first refused (`place`
    puts them under the field), not up front: most fields never show one."""

    def __init__(self, revert: Callable[[], None], place: Callable[[object], None]):
        self.reason: Optional[str] = None
        self.widget = None
        self._revert, self._place = revert, place

    def _build(self) -> None:
        w = _widgets()
        self.text = w.HTML(value="", layout=w.Layout(flex="1 1 auto", min_width="0"))
        self.text.add_class("grpo-lab-field-error")
        button = w.Button(
            description="revert",
            layout=w.Layout(width="auto", flex="0 0 auto"),
            tooltip="show the config's value again",
        )
        button.on_click(lambda _: self._revert())
        # why from the field's left edge, not under its input: the reason gets the row's width (at most 2 lines)
        self.widget = w.HBox([self.text, button], layout=w.Layout(margin="0 0 4px 0", width="100%"))
        self._place(self.widget)

    def show(self, reason: Optional[str]) -> None:
        import html

        self.reason = reason
        if self.widget is None:
            if reason is None:
                return
            self._build()
        self.text.value = "" if reason is None else html.escape(reason, quote=False)
        self.widget.layout.display = "none" if reason is None else "flex"


LEGEND = (
    "<small>Each field's badge says when an edit applies: <b>live</b> at the next phase that reads it, "
    "<b>rebuild</b> rebuilds its part now, <b>load-time</b> is read-only once the Lab is loaded (make a new Lab to "
    "change it). Text fields apply on Enter or when they lose focus; an applied value is ticked, a refused one framed "
    "red with its reason under it.</small>"
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
        looks = Looks(label_width(n for p in schema["properties"].values() for n in _resolve(p, defs)["properties"]))
        self.props: dict[tuple[str, str], dict] = {}  # each field's schema: its help, when it applies, CUDA only
        self.applied: Optional[tuple[str, str]] = None  # the field whose value was applied last (ticked)
        on_cpu = on_the_cpu(config)
        self.sections: dict[str, object] = {}  # each tab's box of rows: an input, then its help line
        # why one fixed height, scrolling inside: tabs of 267 to 1,521 px moved whatever sat under the editor by up to
        # 1,254 px at each tab switch; at a fixed height the panel keeps its shape (one Layout model for all tabs)
        page = w.Layout(height=EDITOR_HEIGHT, overflow="auto")
        for section, prop in schema["properties"].items():
            rows = []
            for name, fprop in _resolve(prop, defs)["properties"].items():
                widget, parse = field_widget(name, fprop, data[section][name], looks)
                widget.observe(self._changed(section, name), names="value")
                self.inputs[(section, name)] = (widget, parse)
                self.errors[(section, name)] = FieldError(self._revert(section, name), self._under(section, name))
                self.props[(section, name)] = fprop
                self.help[(section, name)] = help_line(fprop, looks, cuda=on_cpu and bool(fprop.get("cuda_only")))
                rows += [widget, self.help[(section, name)]]
            self.sections[section] = w.VBox(rows, layout=page)
            # why no shrinking: in a page of fixed height a box (overflow: auto, as ipywidgets makes every box) may
            # shrink to nothing; the refused value's reason row did, out of sight
            self.sections[section].add_class("grpo-lab-page")
        self.tabs = w.Tab(children=list(self.sections.values()))
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
            layout=w.Layout(width="100%", min_width="0"),  # why: it takes the width the notebook has
        )
        self.widget.add_class("grpo-lab-editor")
        self._syncing = False
        self.retired: Optional[str] = None  # why this editor is off (a newer panel edits the config now)
        self.buttons = (self.path, load, save)
        self.lock_load_time()

    def retire(self, why: str) -> None:
        """A newer panel edits this config now: every input is off and the editor hidden, so no two panels show
        different values for one field (an edit there, or in a cell, would leave this one's values behind)."""
        self.retired = why
        for widget, _ in self.inputs.values():
            widget.disabled = True
        for widget in self.buttons:
            widget.disabled = True
        self.widget.layout.display = "none"

    def lock_load_time(self) -> None:
        """Load-time fields are read-only once the Lab is loaded (and editable again before); all are on a retired
        editor."""
        if self.retired is not None:
            return
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
        if self.retired is not None:  # what a disabled input cannot send, set() refuses
            self.errors[(section, name)].show(self.retired)
            return False
        try:
            changed = self.config.update({path: parse(raw)})
        except (LabError, yaml.YAMLError, ValueError, TypeError) as err:
            keeps = as_text(self.config.to_dict()[section][name])
            self.errors[(section, name)].show(f"{str(err).strip()} (not applied; stays {keeps})")
            self.message.value = ""
            self._mark((section, name), refused=True)
            return False
        self.errors[(section, name)].show(None)
        self._mark((section, name), applied=as_text(self.config.to_dict()[section][name]))
        when = field_when(path)
        self.message.value = f"{path}: {WHEN[when]}" if changed else ""
        self.refresh()
        if self.on_change:
            self.on_change(self.config)
        return True

    def _mark(self, key: tuple[str, str], refused: bool = False, applied: str = "") -> None:
        """A refused field framed red (till it is corrected or reverted); an applied one framed green with its value
        ticked in its help line, the last applied field's tick cleared (one tick: the latest edit)."""
        widget = self.inputs[key][0]
        if applied and self.applied not in (None, key):
            self._mark(self.applied)
        for name, on in (("grpo-lab-refused", refused), ("grpo-lab-applied", bool(applied))):
            if on and name not in widget._dom_classes:
                widget.add_class(name)
            elif not on and name in widget._dom_classes:
                widget.remove_class(name)
        cuda = on_the_cpu(self.config) and bool(self.props[key].get("cuda_only"))
        self.help[key].value = help_html(self.props[key], applied, cuda)
        self.applied = key if applied else (None if self.applied == key else self.applied)

    def _error(self, err) -> None:
        import html

        self.message.value = (
            f"<span style='color:var(--jp-error-color1, #c00)'>{html.escape(str(err), quote=False)}</span>"
        )

    def _under(self, section: str, name: str) -> Callable[[object], None]:
        """Puts a field's error row right under its input (made when its first value is refused)."""

        def place(row) -> None:
            box = self.sections[section]
            rows = list(box.children)
            at = next(i for i, r in enumerate(rows) if r is self.inputs[(section, name)][0]) + 1
            box.children = tuple(rows[:at] + [row] + rows[at:])

        return place

    def _revert(self, section: str, name: str) -> Callable[[], None]:
        def revert():
            self.errors[(section, name)].show(None)
            self._mark((section, name))
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
        if self.retired is not None:
            self._error(self.retired)
            return
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
