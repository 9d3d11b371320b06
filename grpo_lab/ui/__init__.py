"""Notebook widgets: the config editor, step controls and the panel that puts them beside the live plot."""

from .controls import StepControls
from .editor import ConfigEditor

__all__ = ["ConfigEditor", "StepControls", "Panel"]

STALE_STYLE = (
    "padding:4px 8px;border-left:4px solid var(--jp-warn-color1, #f0ad4e);"
    "background:var(--jp-layout-color2, #f5f5f5);color:var(--jp-ui-font-color1, #222)"
)


class Panel:
    """`lab.ui()`: the step controls, the log under them at the output's width, the live memory plot, then the config
    editor. Panels of one Lab are numbered; a newer one retires this one (`retire`)."""

    def __init__(self, lab, number: int = 1):
        from .editor import _widgets

        w = _widgets()
        self.number = number
        self.editor = ConfigEditor(lab.config, loaded=lambda: lab.learner is not None)  # edits lab.config in place
        self.controls = StepControls(lab)
        self.plot = lab.memory_plot() if lab.memory is not None and lab.learner is not None else None
        from .live import PLOT_CSS

        style = w.HTML(value=PLOT_CSS, layout=w.Layout(display="none"))  # the plot follows the theme (live.PLOT_CSS)
        self.note = w.HTML(value="", layout=w.Layout(display="none", width="100%"))  # a stale panel's one line
        # why this order: what a person watches while stepping (the buttons, the latest log line, the plot with its
        # axis) fits a 679 px view at 1280 x 800 with the file browser open; the editor, of a fixed height that
        # scrolls inside itself, comes after, so a tab switch moves none of them
        parts = [style, self.note, self.controls.buttons, self.controls.log_box]
        if self.plot is not None:
            parts.append(self.plot.fig)
        self.widget = w.VBox(parts + [self.editor.widget], layout=w.Layout(width="100%"))
        self.widget.add_class("grpo-lab-panel")

    def retire(self, live: int) -> None:
        """Panel `live` replaced this one: its editor is off (and hidden: no two panels show one field's values),
        its buttons off, and a line says which panel is live (its plot's title says it stopped)."""
        import html

        why = f"panel {self.number} was replaced by panel {live} (lab.ui() ran again); use panel {live}"
        self.editor.retire(why)
        self.controls.retire(why)
        line = f"{why}: this one's editor and buttons are off (its log and plot stay as they were)"
        self.note.value = f"<div style='{STALE_STYLE}'><b>stale:</b> {html.escape(line, quote=False)}</div>"
        self.note.layout.display = "block"

    def text(self) -> str:
        """The panel in one line: what a saved notebook shows where no widget is drawn."""
        state = "stale: " + self.controls.retired if self.controls.retired else "config editor, step controls"
        plot = ", live memory plot" if self.plot is not None and not self.controls.retired else ""
        return f"grpo_lab panel {self.number} ({state}{plot}); drawn live: lab.memory_snapshot() keeps the plot"

    def _ipython_display_(self):
        from IPython.display import display

        if self.plot is not None:
            self.plot.refresh()
        display(self.mimebundle(), raw=True)

    def mimebundle(self) -> dict:
        """The widget's view with a one-line text/plain: the widget's own is its whole tree (VBox(children=(HTML(...)"""
        return {**self.widget._repr_mimebundle_(), "text/plain": self.text()}
