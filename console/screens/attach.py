"""`kvdeck attach URL`: the console over a remote engine's Prometheus metrics (kvdeck, vLLM,
SGLang, llama.cpp). Panels whose data the remote exposes are live; the others say what that
server does not expose. Polling runs in a worker thread; a failed scrape is shown and retried.
"""

from __future__ import annotations

import time
from collections import deque

import httpx
from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.widgets import Header, Static
from textual.worker import get_current_worker

from kvdeck.console.base_app import ConsoleApp
from kvdeck.console.widgets.footer import KeysFooter
from kvdeck.console.widgets.metrics import sparkline
from kvdeck.console.widgets.prefix_tree import PrefixTreePanel
from kvdeck.console.widgets.remote_prefix import UNKNOWN
from kvdeck.console.widgets.routing import RoutingPanel
from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.fleet.fleet_tree import segments
from kvdeck.runtime.fleet.replica_cache import ReplicaCache
from kvdeck.runtime.fleet.subscriber import Subscriber, SubscriberStatus
from kvdeck.runtime.runs.attach import Rates, RemoteStatus, metrics_url, parse_metrics, parse_slots


def fmt_ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:,.0f}"


class AttachApp(ConsoleApp):
    TITLE = "kvdeck attach"
    CSS = """
    Grid { grid-size: 3 2; }
    Grid > .panel { border: round $primary; padding: 0 1; height: 1fr; }
    Grid > .panel.stale { color: $text-disabled; border: round $warning; }
    #prefix { height: auto; max-height: 50%; }
    #prefix-tree { border: none; padding: 0; display: none; }
    """
    BINDINGS = [Binding("q", "quit", "Quit", id="attach.quit"),
                Binding("t", "next_theme", "Theme", id="attach.theme"),
                Binding("f1", "help", "Help", id="attach.help")]

    def __init__(self, url: str, interval_s: float = 1.0, kv_events: str | None = None,
                 kv_replay: str | None = None, kv_topic: str = "", tokenizer=None):
        """`kv_events`: the server's KV-events endpoint as it was told it (`--kv-events-config`'s
        `endpoint`), `kv_replay` its replay endpoint; `tokenizer` decodes cached spans."""
        super().__init__()
        self.metrics_url = metrics_url(url)
        self.subscriber = Subscriber(kv_events, replay=kv_replay, topic=kv_topic,
                                     host=httpx.URL(url).host) if kv_events else None
        self.tokenizer = tokenizer
        self.events: tuple[list, SubscriberStatus, ReplicaCache] | None = None
        self.interval_s = interval_s
        self.status: RemoteStatus | None = None
        self.error: str | None = None
        self.scrapes = 0
        self.last_ok: float | None = None
        """Monotonic time of the last successful scrape (what the panels show is from then)."""
        self.rates: Rates | None = None
        self.preemptions_seen = 0.0
        self.history: dict[str, deque[float]] = {k: deque(maxlen=120)
                                                 for k in ("running", "waiting", "kv_usage")}
        self.sub_title = self.metrics_url

    def compose(self) -> ComposeResult:
        yield Header()
        with Grid():
            for name, title in (("queue", "Queue"), ("kv", "KV cache"), ("prefix", "Prefix cache"),
                                ("latency", "Latency"), ("spec", "Speculation"),
                                ("status", "Remote")):
                if name == "prefix":  # figures, then the tree its KV events build
                    panel = Vertical(Static(id="prefix"), PrefixTreePanel(id="prefix-tree"),
                                     id="prefix-cell", classes="panel")
                else:
                    panel = Static(id=name, classes="panel")
                panel.border_title = title
                yield panel
        yield KeysFooter()

    def on_mount(self) -> None:
        self.setup_themes()
        if self.subscriber is not None:
            self.subscriber.start()
        self.run_worker(self._poll, thread=True, exclusive=True)

    def on_unmount(self) -> None:
        if self.subscriber is not None:
            self.subscriber.stop()

    def _read_events(self) -> None:
        """Worker thread: the subscriber's cache as segments (the UI thread only draws)."""
        if self.subscriber is not None:
            cache, status = self.subscriber.snapshot()
            self.events = (segments(cache), status, cache)

    def _poll(self) -> None:
        """Worker thread: scrape until the app cancels the worker on exit."""
        worker = get_current_worker()
        with httpx.Client(timeout=5.0) as client:
            while not worker.is_cancelled:
                try:
                    r = client.get(self.metrics_url)
                    r.raise_for_status()
                    status, error = parse_metrics(r.text), None
                    if status.engine == "llama.cpp":
                        slots = client.get(self.metrics_url.removesuffix("/metrics") + "/slots")
                        if slots.status_code == 200:  # absent when started with --no-slots
                            status.slots_busy, status.slots_total = parse_slots(slots.json())
                except (httpx.HTTPError, KvdeckError, ValueError) as e:
                    status, error = None, f"{type(e).__name__}: {e}"
                if worker.is_cancelled:
                    break
                self._read_events()
                self.call_from_thread(self.show, status, error)
                time.sleep(self.interval_s)

    def show(self, status: RemoteStatus | None, error: str | None) -> None:
        self.scrapes += 1
        self.error = error
        now = time.monotonic()
        if status is not None:
            if self.status is not None and self.last_ok is not None:
                self.rates = Rates.between(self.status, status, now - self.last_ok)
                self.preemptions_seen += self.rates.new_preemptions or 0.0
            self.status, self.last_ok = status, now
            for key in self.history:
                value = getattr(status, key)
                if value is not None:
                    self.history[key].append(value)
        st = self.status
        stale = error is not None and st is not None
        age = f"stale: no answer for {now - self.last_ok:,.0f} s" if stale else ""
        for panel in self.query("Grid > .panel"):
            panel.set_class(stale and panel.id != "status", "stale")
            if panel.id != "status":
                panel.border_subtitle = age
        self.query_one("#status", Static).update(Text(
            (f"{st.engine} at {self.metrics_url}\n" if st else "") +
            (f"last scrape failed: {error}" if error else f"scrape #{self.scrapes} ok") +
            ("\nthe other panels show the last good scrape, "
             f"{now - self.last_ok:,.0f} s ago" if stale else "") +
            ("\nnot exposed: " + ", ".join(st.missing()) if st and st.missing() else ""),
            style="red" if error else ""))
        if st is None or status is None:
            return  # nothing new: the panels keep the last good scrape, marked stale
        r = self.rates
        peak = max(list(self.history["running"]) + list(self.history["waiting"]) + [1.0])
        slots = f" · slots {st.slots_busy}/{st.slots_total} busy" \
            if st.slots_total is not None else ""
        done = f"{r.requests_per_s:.2f} req/s finishing" if r and r.requests_per_s is not None \
            else ("request rate: after the next scrape" if st.requests_done is not None
                  else f"{st.engine} does not export a finished-request count")
        preempt = f" · preemptions {st.preemptions:,.0f} (+{self.preemptions_seen:,.0f} " \
                  "while attached)" if st.preemptions is not None else ""
        self.query_one("#queue", Static).update(Group(
            Text(f"running {self._num(st.running)} · waiting {self._num(st.waiting)}{slots}"),
            Text(done + preempt),
            Text("running ").append_text(sparkline(list(self.history["running"]), set(), 40,
                                                   peak)),
            Text("waiting ").append_text(sparkline(list(self.history["waiting"]), set(), 40,
                                                   peak))))
        kv = Text(f"usage {st.kv_usage:.0%}\n" if st.kv_usage is not None
                  else f"{st.engine} does not expose KV usage\n")
        kv.append_text(sparkline(list(self.history["kv_usage"]), set(), 40))
        if st.kv_blocks:
            kv.append("\n" + " · ".join(f"{k} {int(v)}" for k, v in st.kv_blocks.items()))
        prefix = Text(f"hit rate {st.hit_rate:.1%}" if st.hit_rate is not None
                      else f"{st.engine} does not expose prefix-cache hits")
        if self.events is not None:
            kv.append_text(self._residency(st))
            prefix.append("\n")
            prefix.append_text(self._tree())
        else:
            prefix.append("\nthe tree needs the server's KV events: --kv-events ENDPOINT "
                          "(docs/attach.md)", style="dim")
        self.query_one("#kv", Static).update(kv)
        self.query_one("#prefix", Static).update(prefix)
        lines = []
        for name, h in (("TTFT", st.ttft), ("ITL", st.itl), ("E2E", st.e2e)):
            lines.append(f"{name:5} p50 {fmt_ms(h.quantile(0.5))} ms · p99 "
                         f"{fmt_ms(h.quantile(0.99))} ms · n {int(h.count)}" if h is not None
                         else f"{name:5} not exposed by {st.engine}")
        if r is not None and r.generation_tokens_per_s is not None:
            lines.append(f"throughput: generation {r.generation_tokens_per_s:,.1f} tok/s · "
                         f"prompt {self._num(r.prompt_tokens_per_s)} tok/s")
        elif st.generated_tokens_per_s is not None:
            lines.append(f"generation {st.generated_tokens_per_s:,.1f} tokens/s")
        self.query_one("#latency", Static).update("\n".join(lines))
        self._routing(st)
        self.query_one("#spec", Static).update(
            f"acceptance {st.spec_acceptance:.2f} tokens per draft"
            + (f", {st.spec_acceptance_rate:.0%} of draft tokens"
               if st.spec_acceptance_rate is not None else "")
            if st.spec_acceptance is not None
            else f"{st.engine} reports no speculative decoding")

    def _routing(self, st: RemoteStatus) -> None:
        """A kvdeck server with a cascade: its routing panel, mounted on first sight."""
        if st.cascade is None:
            return
        if not self.query(RoutingPanel):
            self.mount(RoutingPanel(id="routing"), before=self.query_one(KeysFooter))
        self.query_one(RoutingPanel).show(st.cascade)

    def _residency(self, st: RemoteStatus) -> Text:
        segs, status, cache = self.events
        gpu, cpu = cache.resident("GPU"), cache.resident("CPU")
        pool = f" of {st.num_gpu_blocks:,.0f}" if st.num_gpu_blocks else ""
        return Text(f"\ncached blocks (events): {gpu:,} on GPU{pool}" +
                    (f", {cpu:,} on CPU" if cpu else "") +
                    (f" · {cache.block_size}-token blocks" if cache.block_size else ""))

    def _tree(self) -> Text:
        """The events' figures; the tree itself goes to the prefix tree panel."""
        segs, status, cache = self.events
        now = time.monotonic()
        head = Text(f"KV events: {status.messages:,} messages"
                    + (f", last {now - status.last_message_s:,.0f} s ago"
                       if status.last_message_s is not None else ", none yet")
                    + (f", {status.refilled} replayed" if status.refilled else ""))
        if status.gaps:
            missed = sum(b - a + 1 for a, b in status.gaps)
            head.append(f" · {missed} lost (no replay endpoint)", style="yellow")
        if status.error:
            head.append(f"\n{status.error}", style="red")
        if status.unknown:
            head.append(f"\nskipped: {', '.join(f'{k} ×{v}' for k, v in status.unknown.items())}",
                        style="dim")
        head.append(f"\n{UNKNOWN}", style="dim")
        tree = self.query_one(PrefixTreePanel)
        tree.display = True
        tree.show_segments(segs, self.tokenizer.decode if self.tokenizer is not None else None,
                           f"{len(segs):,} segments")
        return head

    @staticmethod
    def _num(x: float | None) -> str:
        return "—" if x is None else f"{x:.0f}"
