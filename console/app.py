"""The kvdeck operator console: a Textual app over a running engine.

The engine runs in its own thread (`EngineLoop`). Snapshots arrive from that thread through
`post_message`; while one is waiting to be rendered, newer ones replace it instead of
queueing, so the UI never falls behind and the engine never waits for it. Panels read only
snapshots. Knob changes, pause, single steps, and starting or stopping a recording go back
through the engine's inbox and apply at the next iteration; the UI thread never steps the
engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Header, Input

from kvdeck.console.base_app import ConsoleApp
from kvdeck.console.layout import SNAPSHOT_PANELS, compose_panels
from kvdeck.console.prompt_options import parse_prompt
from kvdeck.console.screens.charts import ChartsScreen
from kvdeck.console.screens.plan import PlanScreen
from kvdeck.console.screens.requests import RequestsScreen
from kvdeck.console.widgets.banner import Banner
from kvdeck.console.widgets.footer import KeysFooter
from kvdeck.console.widgets.hardware import HardwareStrip
from kvdeck.console.widgets.knobs import TRAFFIC_KNOBS, KnobEditor, KnobsPanel, parse_knob, shown
from kvdeck.console.widgets.kv_map import KVMapPanel, switch_text
from kvdeck.console.widgets.prefix_tree import PrefixTreePanel
from kvdeck.console.widgets.prompt import (
    CHAT_MAX_TOKENS,
    COMPLETION_MAX_TOKENS,
    PromptPanel,
    prompt_mode,
)
from kvdeck.console.widgets.queue import QueuePanel
from kvdeck.console.widgets.routing import RoutingPanel
from kvdeck.runtime.core.commands import SetPriority, Watch
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.runs.loop import EngineLoop
from kvdeck.runtime.runs.recording import Recorder, record_live, stop_live
from kvdeck.runtime.runs.traffic import TrafficGenerator
from kvdeck.runtime.server.cascade import CascadeView
from kvdeck.runtime.settings import Settings, to_toml
from kvdeck.runtime.views.snapshot import EngineSnapshot, snapshot_of


class SnapshotReady(Message):
    """A new snapshot is waiting in `KvdeckApp.latest` (coalesced: at most one queued)."""


class KvdeckApp(ConsoleApp):
    """Live view of one engine, its knobs, and its recording."""

    TITLE = "kvdeck"
    BINDINGS = [
        # In footer order, the keys an operator needs most first: a narrow terminal's footer
        # keeps the left part.
        Binding("q", "quit", "Quit", id="app.quit"),
        Binding("p", "toggle_pause", "Pause", id="engine.pause"),
        Binding("k", "focus_knobs", "Knobs", id="app.knobs"),
        Binding("l", "requests", "Requests", id="app.requests"),
        Binding("r", "toggle_record", "Record", id="run.record"),
        Binding("slash", "focus_prompt", "Prompt", id="app.prompt"),
        Binding("c", "charts", "Charts", id="app.charts"),
        Binding("f1", "help", "Help", id="app.help"),
        Binding("t", "next_theme", "Theme", id="app.theme"),
        Binding("s", "step_once", "Step", id="engine.step"),
        Binding("plus,equals_sign", "rate(1.5)", "Rate+", id="traffic.faster"),
        Binding("minus", "rate(0.6667)", "Rate-", id="traffic.slower"),
        Binding("n", "select_next", "Select", id="kv.select"),
        Binding("w", "save_settings", "Save", id="run.save"),
        Binding("P", "plan", "Plan", id="app.plan"),
    ]

    def __init__(self, engine: Engine, traffic: TrafficGenerator | None = None, *,
                 autostart: bool = True, hardware: bool = True,
                 runs_dir: Path = Path("runs"), settings: Settings | None = None):
        """`settings`: what the engine was built from, so `w` can save them with the
        knobs as they are now."""
        super().__init__()
        self.engine = engine
        self.settings = settings
        self.traffic = traffic
        self.loop = EngineLoop(engine, on_snapshot=self._on_snapshot, before_step=traffic)
        self.autostart = autostart
        self.hardware = hardware
        self.runs_dir = runs_dir
        self.latest: EngineSnapshot | None = None
        self._last_switch: dict | None = None
        """The newest format switch already announced."""
        self._pending = threading.Event()
        self.recorder: Recorder | None = None
        self.prompt_id: str | None = None
        """The request the prompt panel follows (its text comes in every snapshot)."""
        self.want_paused = False
        """What the operator last asked for; snapshots say when the engine has done it."""
        self._prompts = 0
        self.before_shutdown: list = []
        """Called first when the console quits (e.g. stopping an API server beside it)."""
        self.routing: Callable[[], CascadeView] | None = None
        """The cascade's figures, when the API server beside it routes over two models (set
        before `run`: it adds the routing panel)."""
        self.sub_title = f"{engine.executor.info.model_name} · {engine.executor.info.name}"

    def compose(self) -> ComposeResult:
        yield Header()
        yield Banner(id="banner")
        yield HardwareStrip(enabled=self.hardware, resident=self._resident_bytes, id="hardware")
        yield from compose_panels(routing=self.routing is not None)
        yield PromptPanel(prompt_mode(self.engine.tokenizer)[1], id="prompt")
        yield KeysFooter()

    def _resident_bytes(self) -> tuple[int, int]:
        """(weights, KV pool) bytes the engine holds, for the hardware strip."""
        snap = self.latest or snapshot_of(self.engine)
        kv = snap.kv
        weights = snap.weights.resident_bytes if snap.weights is not None else 0
        return weights, kv.num_blocks * (kv.bytes_per_block + kv.draft_bytes_per_block)

    def on_mount(self) -> None:
        self.setup_themes()
        self.query_one(HardwareStrip).refresh_readings()
        if self.hardware:
            self.every(1.0, self.query_one(HardwareStrip).refresh_readings)
        if self.routing is not None:
            routing = self.query_one(RoutingPanel)
            routing.show(self.routing())
            self.every(1.0, lambda: routing.show(self.routing()))
        snap = snapshot_of(self.engine)
        self.render_snapshot(snap)
        if self.settings is not None and self.settings.executor_choice:
            self.notify(self.settings.executor_choice, title="Executor", timeout=8)
        if snap.weights is not None and snap.weights.kernels:
            self.notify(f"weights {snap.knobs.weight_format}, measured at start-up (ms at "
                        "1/8/32 rows):\n" + "\n".join(snap.weights.kernels),
                        title="Weight formats", timeout=12)
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            # SIGINT and SIGTERM quit as `q` does (not in a test's thread or on Windows).
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.exit)
        if self.autostart:
            self.loop.start()

    def on_unmount(self) -> None:
        """Shut down in order: whatever runs beside the console (an API server) first, while
        the engine can still answer its clients; then the engine thread, after its current
        step; then recorders; then the executor's native resources."""
        for callback in self.before_shutdown:
            callback()
        stopped = not self.loop.is_alive or self.loop.stop()
        # The engine thread has stopped: close any recorder it still holds (a stop asked
        # for in its last moments may not have been applied).
        for rec in (self.recorder, self.engine.recorder):
            if isinstance(rec, Recorder):
                rec.close()
        if stopped:  # never free native resources under a step still running
            self.engine.close()

    # -- snapshots --------------------------------------------------------------------------

    def _on_snapshot(self, snap: EngineSnapshot) -> None:
        """Engine thread: keep only the newest snapshot; post one message at a time."""
        self.latest = snap
        if not self._pending.is_set():
            self._pending.set()
            self.post_message(SnapshotReady())

    def on_snapshot_ready(self, _: SnapshotReady) -> None:
        self._pending.clear()
        # A snapshot posted just before exit can arrive after the panels are removed.
        if self.latest is not None and self.screen_stack and \
                self.screen_stack[0].query(QueuePanel):
            self.render_snapshot(self.latest)

    def render_snapshot(self, snap: EngineSnapshot) -> None:
        """Show `snap` in every panel, and in the request table when it is open (also used
        by tests)."""
        self.latest = snap
        main = self.screen_stack[0]  # the panels, whatever screen is on top of them
        for panel in SNAPSHOT_PANELS:
            main.query_one(panel).show(snap)
        main.query_one(KnobsPanel).show_values(snap.knobs, self.traffic_values(),
                                               snap.pending_knobs, snap.weights,
                                               snap.switches)
        main.query_one(PromptPanel).show_tracked(
            next((t for t in snap.tracked if t.request_id == self.prompt_id), None))
        main.query_one(Banner).show(snap)
        if snap.switches and snap.switches[-1] != self._last_switch:
            self._last_switch = snap.switches[-1]
            knob = self._last_switch.knob
            title = "Weight offload" if knob == "offload_layers" else "Format switched"
            self.notify(switch_text(self._last_switch), title=title)
        if isinstance(self.screen, (RequestsScreen, ChartsScreen, PlanScreen)):
            self.screen.show(snap)
        state = "failed" if snap.failure else "paused" if snap.paused else "running"
        rec = " · recording" if self.recorder is not None else ""
        refused = f" · traffic refused {self.traffic.refused:,}" \
            if self.traffic is not None and self.traffic.refused else ""
        self.sub_title = f"{snap.model_name} · {snap.executor} · {state}{rec}{refused}"

    def traffic_values(self) -> dict[str, float]:
        if self.traffic is None:
            return {}
        mix = self.traffic.mix
        return {"traffic_rate_per_s": round(mix.rate_per_s, 3),
                "traffic_long_fraction": mix.long_fraction}

    # -- knobs ------------------------------------------------------------------------------

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if not isinstance(event.data_table, KnobsPanel):
            return  # another table's row (the request table handles its own)
        current = self.query_one(KnobsPanel).current()
        if current is None:
            return
        name, value = current
        choices = None
        if name == "kv_format" and self.latest is not None and self.latest.kv.formats:
            choices = self.latest.kv.formats  # what this executor can store
        self.push_screen(KnobEditor(name, value, choices),
                         lambda text: self.apply_knob(name, text) if text is not None else None)

    def apply_knob(self, name: str, text: str) -> bool:
        """Validate and submit one knob change; notify either way. True when accepted."""
        try:
            value = parse_knob(name, text)
            if name in TRAFFIC_KNOBS:
                if self.traffic is None:
                    raise KvdeckError("There is no built-in traffic to tune in this session.")
                if name == "traffic_rate_per_s":
                    self.traffic.set_rate(value)  # type: ignore[arg-type]
                else:
                    self.traffic.set_long_fraction(value)  # type: ignore[arg-type]
            else:
                self.engine.set_knobs(**{name: value})
        except KvdeckError as e:
            self.notify(str(e), title="Invalid knob", severity="error")
            return False
        self.notify(f"{name} = {shown(value)} from the next iteration", title="Knob")
        return True

    # -- interactive prompt -----------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "prompt-input":
            if self.submit_prompt(event.value) is not None:
                event.input.value = ""
                self.screen.set_focus(None)  # the console's keys work again; / asks again

    def submit_prompt(self, line: str) -> str | None:
        """Send the prompt line to the engine and follow it in the panels: a chat turn on an
        instruct model, a plain completion otherwise; greedy unless its leading options
        (`console/prompt_options.py`: n=, temp=, seed=, json=, regex=, choice=) say
        otherwise. Returns its request id."""
        tok = self.engine.tokenizer
        chat, _ = prompt_mode(tok)
        try:
            opts = parse_prompt(line)
        except KvdeckError as e:
            self.notify(str(e), title="Prompt", severity="error")
            return None
        text = opts.text
        if not text:
            self.notify("Type a prompt first.", severity="warning")
            return None
        self._prompts += 1
        try:
            if chat:
                ids = tok.encode(tok.render_chat([{"role": "user", "content": text}]),
                                 add_bos=False)
                sampling = SamplingParams(temperature=opts.temperature, seed=opts.seed,
                                          max_tokens=CHAT_MAX_TOKENS, guide=opts.guide,
                                          stop_token_ids=tok.end_of_turn_ids)
            else:
                # Without a tokenizer, bytes stand in for tokens.
                ids = tok.encode(text) if tok is not None else [3 + b for b in text.encode()]
                sampling = SamplingParams(temperature=opts.temperature, seed=opts.seed,
                                          max_tokens=COMPLETION_MAX_TOKENS, guide=opts.guide)
            req = self.engine.add_request(ids, sampling, request_id=f"prompt-{self._prompts}",
                                          track=True, branches=opts.n)
        except KvdeckError as e:
            self.notify(str(e), title="Prompt", severity="error")
            return None
        self.prompt_id = req.request_id
        self.query_one(KVMapPanel).selected = req.request_id
        self.query_one(PrefixTreePanel).selected = req.request_id
        return req.request_id

    def action_focus_prompt(self) -> None:
        self.query_one("#prompt-input", Input).focus()

    # -- actions ----------------------------------------------------------------------------

    def action_toggle_pause(self) -> None:
        self.want_paused = not self.want_paused
        if self.want_paused:
            self.loop.pause()
            self.notify("engine paused (s steps once)")
        else:
            self.loop.resume()
            self.notify("engine resumed")

    def action_step_once(self) -> None:
        if self.want_paused:
            self.loop.step_once()
        else:
            self.notify("pause first (p) to step one iteration at a time")

    def action_requests(self) -> None:
        """The request table: every request, filterable, with abort and priority."""
        if not isinstance(self.screen, RequestsScreen):
            self.push_screen(RequestsScreen())

    def action_charts(self) -> None:
        """Request rate, token rates, step time and KV usage over the kept history."""
        if not isinstance(self.screen, ChartsScreen):
            self.push_screen(ChartsScreen())

    def action_plan(self) -> None:
        """The planner's plane for the workload the engine is seeing."""
        if not isinstance(self.screen, PlanScreen):
            self.push_screen(PlanScreen(self.engine))

    def watch_request(self, request_id: str) -> None:
        """Follow one request: its story in the snapshots, its blocks in the KV map."""
        self.engine.post(Watch(request_id))
        main = self.screen_stack[0]
        main.query_one(KVMapPanel).selected = request_id
        main.query_one(PrefixTreePanel).selected = request_id

    def set_priority(self, request_id: str, priority: int) -> None:
        self.engine.post(SetPriority(request_id, priority))
        self.notify(f"{request_id}: priority {priority} from the next iteration")

    def action_rate(self, factor: float) -> None:
        if self.traffic is not None:
            self.apply_knob("traffic_rate_per_s", f"{self.traffic.mix.rate_per_s * factor:.3f}")

    def action_focus_knobs(self) -> None:
        self.query_one(KnobsPanel).focus()

    def action_toggle_record(self) -> None:
        """Start recording (from the next iteration, with a checkpoint of the state then)
        or stop it."""
        if self.recorder is None:
            run_dir = self.runs_dir / time.strftime("%Y%m%d-%H%M%S")
            try:
                self.recorder = record_live(self.engine, run_dir, write_requests=True)
            except KvdeckError as e:
                self.notify(str(e), title="Recording", severity="error")
                return
            self.notify(f"recording to {run_dir}", title="Recording")
        else:
            run_dir = self.recorder.run_dir
            stop_live(self.engine)
            self.recorder = None
            self.notify(f"saved {run_dir}; replay it with: kvdeck replay {run_dir}",
                        title="Recording")

    def action_save_settings(self) -> None:
        """Write the settings with the current knobs to a config file every command reads."""
        if self.settings is None or self.latest is None:
            self.notify("This console was not started from settings; nothing to save.",
                        severity="warning")
            return
        values = {**self.settings.flat(), **dataclasses.asdict(self.latest.knobs)}
        path = self.runs_dir / f"settings-{time.strftime('%Y%m%d-%H%M%S')}.toml"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(to_toml(values))
        except OSError as e:
            self.notify(f"Cannot write {path}: {e.strerror}.", title="Settings",
                        severity="error")
            return
        self.notify(f"saved {path}; use it with --config {path} (kvdeck serve, run-trace, "
                    "console)", title="Settings")

    def get_system_commands(self, screen):  # the command palette (ctrl+p)
        yield from super().get_system_commands(screen)
        for title, help_text, action in (
            ("Pause / resume engine", "Stop or restart iterations", self.action_toggle_pause),
            ("Step one iteration", "While paused", self.action_step_once),
            ("Start / stop recording", "Write runs/<time>/", self.action_toggle_record),
            ("Save settings", "Knobs as they are now, to a config file",
             self.action_save_settings),
            ("Faster traffic", "Arrival rate × 1.5", lambda: self.action_rate(1.5)),
            ("Slower traffic", "Arrival rate ÷ 1.5", lambda: self.action_rate(0.6667)),
            ("Next theme", "Dark, light, high contrast", self.action_next_theme),
            ("Edit knobs", "Focus the knob table", self.action_focus_knobs),
            ("Highlight next request", "Its blocks in the KV map", self.action_select_next),
            ("Type a prompt", "Send a prompt and watch it stream", self.action_focus_prompt),
            ("Requests", "Every request: filter, sort, details, abort, priority",
             self.action_requests),
            ("Help", "Keys and panels", self.action_help),
        ):
            yield SystemCommand(title, help_text, action)
