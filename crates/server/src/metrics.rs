//! The server's counters, gauges and latency histograms, served as Prometheus text at
//! `GET /metrics` (names prefixed `qwen36_`, and the main ones again under vLLM's `vllm:` names).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use qwen36::engine::{EngineLoad, EngineStatus, StepStats, Usage};
use qwen36::mtp::SpecStats;

/// A cumulative histogram (of seconds, or of counts).
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, seconds: f64) {
        for (c, &b) in self.counts.iter_mut().zip(self.bounds) {
            if seconds <= b {
                *c += 1;
            }
        }
        self.sum += seconds;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        self.render_labeled(out, name, help, "");
    }

    /// The histogram with `labels` (`key="value",...`, or empty) on every sample.
    fn render_labeled(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let lead = leading(labels);
        let set = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        for (c, b) in self.counts.iter().zip(self.bounds) {
            let _ = writeln!(out, "{name}_bucket{{{lead}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{lead}le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(
            out,
            "{name}_sum{set} {}\n{name}_count{set} {}",
            self.sum, self.count
        );
    }
}

/// `labels` (`key="value",...`) as the start of a sample's label set that names one more, or
/// nothing when there are none.
fn leading(labels: &str) -> String {
    if labels.is_empty() {
        String::new()
    } else {
        format!("{labels},")
    }
}

/// A counter of the verifies that accepted each draft position (0-based, label `position`;
/// `labels` before it on every sample, or empty): vLLM's per-position acceptance, whose ratio
/// to the verifies is each position's acceptance rate.
fn per_position(out: &mut String, name: &str, spec: &SpecStats, labels: &str) {
    let _ = writeln!(
        out,
        "# HELP {name} Verify passes that accepted the draft at each position.\n# TYPE {name} counter"
    );
    let lead = leading(labels);
    for (j, v) in spec.accepted_at.iter().enumerate() {
        let _ = writeln!(out, "{name}{{{lead}position=\"{j}\"}} {v}");
    }
}

const TTFT_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const TPOT_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
];
const E2E_BOUNDS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
const STEP_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
];
const STEP_TOKEN_BOUNDS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

#[derive(Debug)]
struct Inner {
    /// Requests taken by the engine, per endpoint.
    requests: BTreeMap<&'static str, u64>,
    /// Choices that ended, per finish reason (`stop`, `length`, `tool_calls`, `abort`, `error`).
    finished: BTreeMap<&'static str, u64>,
    /// HTTP responses per route and status.
    responses: BTreeMap<(&'static str, u16), u64>,
    prompt_tokens: u64,
    generation_tokens: u64,
    /// Speculation counters of the choices that ended, summed.
    spec: SpecStats,
    preemptions: u64,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    /// Each engine step's wall time, its tokens (prefill chunks and decode tokens) and its
    /// sequences.
    step: Histogram,
    step_tokens: Histogram,
    step_sequences: Histogram,
}

/// The server's metrics (shared by every handler).
#[derive(Debug)]
pub struct Metrics(Mutex<Inner>);

impl Default for Metrics {
    fn default() -> Self {
        Self(Mutex::new(Inner {
            requests: BTreeMap::new(),
            finished: BTreeMap::new(),
            responses: BTreeMap::new(),
            prompt_tokens: 0,
            generation_tokens: 0,
            spec: SpecStats::default(),
            preemptions: 0,
            ttft: Histogram::new(TTFT_BOUNDS),
            tpot: Histogram::new(TPOT_BOUNDS),
            e2e: Histogram::new(E2E_BOUNDS),
            step: Histogram::new(STEP_BOUNDS),
            step_tokens: Histogram::new(STEP_TOKEN_BOUNDS),
            step_sequences: Histogram::new(STEP_TOKEN_BOUNDS),
        }))
    }
}

/// What one choice (one engine request) did, recorded when it ends.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChoiceTimes {
    /// From the request's arrival to its first token.
    pub first_token: Option<Duration>,
    /// From the request's arrival to its end.
    pub total: Duration,
}

impl Metrics {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// A request taken by the engine (`endpoint`: `completions` or `chat`) with its prompt.
    pub fn admitted(&self, endpoint: &'static str, prompt_tokens: usize) {
        self.with(|m| {
            *m.requests.entry(endpoint).or_default() += 1;
            m.prompt_tokens += prompt_tokens as u64;
        });
    }

    /// `tokens` more generated (counted as they arrive, so that a long generation shows in the
    /// rate while it runs; a choice cancelled later keeps them counted, as vLLM does).
    pub fn generated(&self, tokens: usize) {
        if tokens > 0 {
            self.with(|m| m.generation_tokens += tokens as u64);
        }
    }

    /// One choice ended with `reason`; `usage` when the engine finished it.
    pub fn finished(&self, reason: &'static str, usage: Option<&Usage>, times: ChoiceTimes) {
        self.with(|m| {
            *m.finished.entry(reason).or_default() += 1;
            if let Some(u) = usage {
                m.spec.add(&u.speculation);
                m.preemptions += u.preemptions as u64;
                if let Some(first) = times.first_token {
                    m.ttft.observe(first.as_secs_f64());
                    if u.completion_tokens > 1 {
                        let rest = times.total.saturating_sub(first).as_secs_f64();
                        m.tpot.observe(rest / (u.completion_tokens - 1) as f64);
                    }
                }
                m.e2e.observe(times.total.as_secs_f64());
            }
        });
    }

    /// One engine step that ran a forward (a step with nothing to run is not counted).
    pub fn step(&self, s: &StepStats) {
        if s.sequences == 0 {
            return;
        }
        self.with(|m| {
            m.step.observe(s.wall.as_secs_f64());
            m.step_tokens.observe(s.tokens as f64);
            m.step_sequences.observe(s.sequences as f64);
        });
    }

    /// An HTTP response on `route` with `status`.
    pub fn response(&self, route: &'static str, status: u16) {
        self.with(|m| *m.responses.entry((route, status)).or_default() += 1);
    }

    /// The Prometheus text of every metric, with the engine's `load` and `status`.
    pub fn render(&self, load: EngineLoad, status: &EngineStatus, steps: u64) -> String {
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        self.with(|m| {
            let _ = writeln!(
                out,
                "# HELP qwen36_requests_total Requests taken by the engine.\n# TYPE qwen36_requests_total counter"
            );
            for endpoint in ["chat", "completions"] {
                let v = m.requests.get(endpoint).copied().unwrap_or(0);
                let _ = writeln!(out, "qwen36_requests_total{{endpoint=\"{endpoint}\"}} {v}");
            }
            let _ = writeln!(
                out,
                "# HELP qwen36_choices_finished_total Choices (one engine request each) that ended, by finish reason.\n# TYPE qwen36_choices_finished_total counter"
            );
            for reason in ["stop", "length", "tool_calls", "abort", "error"] {
                let v = m.finished.get(reason).copied().unwrap_or(0);
                let _ = writeln!(out, "qwen36_choices_finished_total{{reason=\"{reason}\"}} {v}");
            }
            let _ = writeln!(
                out,
                "# HELP qwen36_http_responses_total HTTP responses by route and status.\n# TYPE qwen36_http_responses_total counter"
            );
            for ((route, status), v) in &m.responses {
                let _ = writeln!(out, "qwen36_http_responses_total{{route=\"{route}\",status=\"{status}\"}} {v}");
            }
            counter(&mut out, "qwen36_prompt_tokens_total", "Prompt tokens of the requests taken.", m.prompt_tokens);
            counter(
                &mut out,
                "qwen36_generation_tokens_total",
                "Tokens generated (counted as they arrive).",
                m.generation_tokens,
            );
            counter(
                &mut out,
                "qwen36_spec_verifies_total",
                "Verify passes that checked drafts (speculative decoding).",
                m.spec.verifies() as u64,
            );
            counter(
                &mut out,
                "qwen36_spec_draft_tokens_total",
                "Draft tokens verified (speculative decoding).",
                m.spec.drafted as u64,
            );
            counter(
                &mut out,
                "qwen36_spec_accepted_tokens_total",
                "Draft tokens accepted (speculative decoding).",
                m.spec.accepted as u64,
            );
            per_position(&mut out, "qwen36_spec_accepted_tokens_per_position_total", &m.spec, "");
            counter(
                &mut out,
                "qwen36_preemptions_total",
                "Times a sequence was preempted (freed and recomputed later).",
                m.preemptions,
            );
            m.ttft.render(&mut out, "qwen36_time_to_first_token_seconds", "From a request's arrival to its first token.");
            m.tpot.render(&mut out, "qwen36_time_per_output_token_seconds", "Mean time between a choice's tokens after the first.");
            m.e2e.render(&mut out, "qwen36_e2e_request_latency_seconds", "From a request's arrival to a choice's end.");
            m.step.render(&mut out, "qwen36_engine_step_seconds", "Wall time of each engine step that ran a forward.");
            m.step_tokens.render(&mut out, "qwen36_engine_step_tokens", "Tokens of each engine step (prefill chunks and decode tokens).");
            m.step_sequences.render(&mut out, "qwen36_engine_step_sequences", "Sequences in each engine step.");
        });
        gauge(
            &mut out,
            "qwen36_requests_waiting",
            "Requests waiting for a slot.",
            load.waiting as f64,
        );
        gauge(
            &mut out,
            "qwen36_requests_running",
            "Sequences running (holding a slot).",
            load.running as f64,
        );
        gauge(
            &mut out,
            "qwen36_state_slots_used",
            "GDN state slots in use.",
            load.slots_used as f64,
        );
        gauge(
            &mut out,
            "qwen36_state_slots",
            "GDN state slots in the pool.",
            load.slots as f64,
        );
        gauge(
            &mut out,
            "qwen36_kv_blocks_used",
            "KV blocks in use.",
            load.blocks_used as f64,
        );
        gauge(
            &mut out,
            "qwen36_kv_blocks",
            "KV blocks in the pool.",
            load.blocks as f64,
        );
        if let Some(p) = load.prefix {
            counter(
                &mut out,
                "qwen36_prefix_cache_lookup_tokens_total",
                "Prompt tokens of the requests admitted.",
                p.lookup_tokens,
            );
            counter(
                &mut out,
                "qwen36_prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache.",
                p.hit_tokens,
            );
            counter(
                &mut out,
                "qwen36_prefix_cache_hits_total",
                "Admissions that started from a cached prefix.",
                p.hits,
            );
            counter(
                &mut out,
                "qwen36_prefix_cache_evictions_total",
                "Cached blocks and snapshots freed to make room.",
                p.evictions,
            );
            gauge(
                &mut out,
                "qwen36_prefix_cache_blocks",
                "KV blocks the prefix cache keeps.",
                p.blocks as f64,
            );
            gauge(
                &mut out,
                "qwen36_prefix_cache_snapshots",
                "GDN state snapshots the prefix cache keeps.",
                p.snapshots as f64,
            );
            gauge(
                &mut out,
                "qwen36_prefix_cache_snapshot_bytes",
                "Memory of the prefix cache's GDN state snapshots.",
                (p.snapshots as u64 * load.slot_bytes) as f64,
            );
        }
        counter(
            &mut out,
            "qwen36_engine_steps_total",
            "Forward steps the engine ran.",
            steps,
        );
        gauge(
            &mut out,
            "qwen36_engine_up",
            "1 while the engine takes requests.",
            f64::from(u8::from(*status == EngineStatus::Running)),
        );
        out
    }
}

impl Metrics {
    /// The main metrics again under vLLM's names (`vllm:*`, labelled `model_name`), for the
    /// dashboards, autoscalers and routers written against vLLM: the same values as the
    /// `qwen36_*` families (finish reasons as vLLM counts them: `tool_calls` is a `stop`).
    /// The time per output token is each request's mean (vLLM's
    /// `request_time_per_output_token_seconds`; its per-token `inter_token_latency_seconds` is
    /// not served).
    pub fn render_vllm(&self, load: EngineLoad, model: &str) -> String {
        let mut out = String::new();
        let model = model
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        let labels = format!("model_name=\"{model}\"");
        let one = |out: &mut String, kind: &str, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {v}"
            );
        };
        one(
            &mut out,
            "gauge",
            "vllm:num_requests_running",
            "Requests running.",
            load.running as f64,
        );
        one(
            &mut out,
            "gauge",
            "vllm:num_requests_waiting",
            "Requests waiting.",
            load.waiting as f64,
        );
        let usage = match load.blocks {
            0 => 0.0,
            n => load.blocks_used as f64 / n as f64,
        };
        one(
            &mut out,
            "gauge",
            "vllm:kv_cache_usage_perc",
            "KV-cache usage (1 = full).",
            usage,
        );
        one(
            &mut out,
            "gauge",
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage (1 = full; vLLM's older name).",
            usage,
        );
        if let Some(p) = load.prefix {
            one(
                &mut out,
                "counter",
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                p.lookup_tokens as f64,
            );
            one(
                &mut out,
                "counter",
                "vllm:prefix_cache_hits_total",
                "Prompt tokens served from the prefix cache.",
                p.hit_tokens as f64,
            );
        }
        self.with(|m| {
            one(&mut out, "counter", "vllm:prompt_tokens_total", "Prompt tokens of the requests taken.", m.prompt_tokens as f64);
            one(&mut out, "counter", "vllm:generation_tokens_total", "Tokens generated.", m.generation_tokens as f64);
            one(&mut out, "counter", "vllm:num_preemptions_total", "Preemptions.", m.preemptions as f64);
            one(&mut out, "counter", "vllm:spec_decode_num_drafts_total", "Verify passes that checked drafts.", m.spec.verifies() as f64);
            one(&mut out, "counter", "vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified.", m.spec.drafted as f64);
            one(&mut out, "counter", "vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", m.spec.accepted as f64);
            per_position(&mut out, "vllm:spec_decode_num_accepted_tokens_per_pos_total", &m.spec, &labels);
            let _ = writeln!(
                out,
                "# HELP vllm:request_success_total Finished requests, by finish reason.\n# TYPE vllm:request_success_total counter"
            );
            let count = |r: &str| m.finished.get(r).copied().unwrap_or(0);
            for (reason, v) in [
                ("stop", count("stop") + count("tool_calls")),
                ("length", count("length")),
                ("abort", count("abort")),
                ("error", count("error")),
            ] {
                let _ = writeln!(out, "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {v}");
            }
            m.ttft.render_labeled(&mut out, "vllm:time_to_first_token_seconds", "Time to the first token.", &labels);
            m.tpot.render_labeled(&mut out, "vllm:request_time_per_output_token_seconds", "A request's mean time per output token after the first.", &labels);
            m.e2e.render_labeled(&mut out, "vllm:e2e_request_latency_seconds", "From arrival to the end.", &labels);
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A histogram's buckets are cumulative and its sum and count follow the observations.
    #[test]
    fn histograms_are_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for s in [0.05, 0.1, 0.5, 2.0] {
            h.observe(s);
        }
        assert_eq!(h.counts, vec![2, 3]);
        assert_eq!(h.count, 4);
        assert!((h.sum - 2.65).abs() < 1e-12);
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.1\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"));
        assert!(out.contains("x_count 4\n"));
        let mut out = String::new();
        h.render_labeled(&mut out, "x", "help", "m=\"a\"");
        assert!(out.contains("x_bucket{m=\"a\",le=\"0.1\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{m=\"a\",le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_sum{m=\"a\"} 2.65\nx_count{m=\"a\"} 4\n"), "{out}");
    }

    /// A choice's usage (7 prompt and 5 output tokens; two verifies, of 3 drafts with 2 accepted
    /// and of 1 accepted: 4 drafted and 3 accepted, drafts 0 and 1 accepted twice and once;
    /// preempted twice) and times (first token at 200 ms, the end at 600 ms).
    fn a_choice() -> (Usage, ChoiceTimes) {
        let mut speculation = SpecStats::default();
        speculation.record(3, 2, 3);
        speculation.record(1, 1, 3);
        let usage = Usage {
            prompt_tokens: 7,
            completion_tokens: 5,
            preemptions: 2,
            speculation,
            ..Usage::default()
        };
        let times = ChoiceTimes {
            first_token: Some(Duration::from_millis(200)),
            total: Duration::from_millis(600),
        };
        (usage, times)
    }

    /// vLLM's names carry the same values, labelled with the model (quotes escaped), finish
    /// reasons as vLLM counts them, KV usage as a fraction, prefix-cache tokens only when it is on.
    #[test]
    fn vllm_names_carry_the_same_values() {
        let m = Metrics::default();
        m.admitted("chat", 7);
        let (usage, times) = a_choice();
        for reason in ["stop", "tool_calls", "length"] {
            m.generated(5);
            m.finished(reason, Some(&usage), times);
        }
        m.finished("abort", None, ChoiceTimes::default());
        let load = EngineLoad {
            running: 3,
            waiting: 1,
            blocks: 8,
            blocks_used: 2,
            ..EngineLoad::default()
        };
        let text = m.render_vllm(load, "q\"1");
        let l = "model_name=\"q\\\"1\"";
        for line in [
            format!("vllm:num_requests_running{{{l}}} 3"),
            format!("vllm:num_requests_waiting{{{l}}} 1"),
            format!("vllm:kv_cache_usage_perc{{{l}}} 0.25"),
            format!("vllm:gpu_cache_usage_perc{{{l}}} 0.25"),
            format!("vllm:prompt_tokens_total{{{l}}} 7"),
            format!("vllm:generation_tokens_total{{{l}}} 15"),
            format!("vllm:num_preemptions_total{{{l}}} 6"),
            format!("vllm:spec_decode_num_drafts_total{{{l}}} 6"),
            format!("vllm:spec_decode_num_draft_tokens_total{{{l}}} 12"),
            format!("vllm:spec_decode_num_accepted_tokens_total{{{l}}} 9"),
            format!("vllm:spec_decode_num_accepted_tokens_per_pos_total{{{l},position=\"0\"}} 6"),
            format!("vllm:spec_decode_num_accepted_tokens_per_pos_total{{{l},position=\"1\"}} 3"),
            format!("vllm:spec_decode_num_accepted_tokens_per_pos_total{{{l},position=\"2\"}} 0"),
            format!("vllm:request_success_total{{{l},finished_reason=\"stop\"}} 2"),
            format!("vllm:request_success_total{{{l},finished_reason=\"length\"}} 1"),
            format!("vllm:request_success_total{{{l},finished_reason=\"abort\"}} 1"),
            format!("vllm:request_success_total{{{l},finished_reason=\"error\"}} 0"),
            format!("vllm:time_to_first_token_seconds_count{{{l}}} 3"),
            format!("vllm:request_time_per_output_token_seconds_bucket{{{l},le=\"0.16\"}} 3"),
            format!("vllm:e2e_request_latency_seconds_count{{{l}}} 3"),
        ] {
            assert!(text.lines().any(|x| x == line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains("prefix_cache"), "{text}");
        let with_prefix = EngineLoad {
            prefix: Some(qwen36::engine::PrefixStats {
                lookup_tokens: 300,
                hit_tokens: 240,
                ..Default::default()
            }),
            ..EngineLoad::default()
        };
        let text = m.render_vllm(with_prefix, "q");
        for line in [
            "vllm:prefix_cache_queries_total{model_name=\"q\"} 300",
            "vllm:prefix_cache_hits_total{model_name=\"q\"} 240",
            "vllm:kv_cache_usage_perc{model_name=\"q\"} 0",
        ] {
            assert!(text.lines().any(|x| x == line), "missing {line:?} in\n{text}");
        }
    }

    /// The prefix cache's counters and memory are shown when it is on, and only then.
    #[test]
    fn prefix_cache_metrics_follow_the_engine() {
        let m = Metrics::default();
        let off = m.render(EngineLoad::default(), &EngineStatus::Running, 0);
        assert!(!off.contains("qwen36_prefix_cache"), "{off}");
        let load = EngineLoad {
            prefix: Some(qwen36::engine::PrefixStats {
                lookups: 3,
                hits: 2,
                lookup_tokens: 300,
                hit_tokens: 240,
                blocks: 15,
                snapshots: 4,
                evictions: 1,
            }),
            slot_bytes: 1000,
            ..EngineLoad::default()
        };
        let text = m.render(load, &EngineStatus::Running, 0);
        for line in [
            "qwen36_prefix_cache_lookup_tokens_total 300",
            "qwen36_prefix_cache_hit_tokens_total 240",
            "qwen36_prefix_cache_hits_total 2",
            "qwen36_prefix_cache_evictions_total 1",
            "qwen36_prefix_cache_blocks 15",
            "qwen36_prefix_cache_snapshots 4",
            "qwen36_prefix_cache_snapshot_bytes 4000",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }

    /// Tokens count as they arrive; a finished choice adds its first-token time and its time per
    /// later token (the usage's tokens are not counted again).
    #[test]
    fn a_finished_choice_counts_its_tokens_and_times() {
        let m = Metrics::default();
        m.admitted("chat", 7);
        let (usage, times) = a_choice();
        m.generated(3);
        m.generated(0);
        m.generated(2);
        m.finished("stop", Some(&usage), times);
        m.finished("abort", None, ChoiceTimes::default());
        m.response("chat", 200);
        let text = m.render(EngineLoad::default(), &EngineStatus::Running, 3);
        for line in [
            "qwen36_requests_total{endpoint=\"chat\"} 1",
            "qwen36_choices_finished_total{reason=\"stop\"} 1",
            "qwen36_choices_finished_total{reason=\"abort\"} 1",
            "qwen36_prompt_tokens_total 7",
            "qwen36_generation_tokens_total 5",
            "qwen36_spec_verifies_total 2",
            "qwen36_spec_draft_tokens_total 4",
            "qwen36_spec_accepted_tokens_total 3",
            "qwen36_spec_accepted_tokens_per_position_total{position=\"0\"} 2",
            "qwen36_spec_accepted_tokens_per_position_total{position=\"1\"} 1",
            "qwen36_spec_accepted_tokens_per_position_total{position=\"2\"} 0",
            // (0.6 − 0.2) / 4 = 0.1 s per later token.
            "qwen36_time_per_output_token_seconds_sum 0.1",
            "qwen36_time_to_first_token_seconds_sum 0.2",
            "qwen36_http_responses_total{route=\"chat\",status=\"200\"} 1",
            "qwen36_engine_steps_total 3",
            "qwen36_engine_up 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }
    /// Steps that ran a forward add their wall time, tokens and sequences; an empty step adds
    /// nothing.
    #[test]
    fn steps_fill_their_histograms() {
        let m = Metrics::default();
        let step = |sequences, tokens, ms| StepStats {
            sequences,
            tokens,
            wall: Duration::from_millis(ms),
            ..StepStats::default()
        };
        m.step(&step(3, 700, 40));
        m.step(&step(16, 16, 15));
        m.step(&step(0, 0, 2));
        let text = m.render(EngineLoad::default(), &EngineStatus::Running, 3);
        for line in [
            "qwen36_engine_step_seconds_count 2",
            "qwen36_engine_step_seconds_sum 0.055",
            "qwen36_engine_step_seconds_bucket{le=\"0.02\"} 1",
            "qwen36_engine_step_tokens_sum 716",
            "qwen36_engine_step_tokens_bucket{le=\"16\"} 1",
            "qwen36_engine_step_tokens_bucket{le=\"1024\"} 2",
            "qwen36_engine_step_sequences_sum 19",
            "qwen36_engine_step_sequences_bucket{le=\"4\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }
}
