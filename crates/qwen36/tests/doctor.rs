//! The doctor: it passes the bundled model and the HF fixtures, and fails each injected fault
//! (feature `fault-injection` of qwen36-model, enabled for tests only) with its own diagnosis;
//! the repetition detector stays quiet on held-out text and the bundled model's samples and
//! fires on loops.

use std::path::Path;

use qwen36::doctor::{
    convention_checks, examine, numerics_checks, speculation_checks, Check, DoctorOptions, Status,
};
use qwen36::model::{Fault, LoadOptions, MtpHead, Qwen36Model};
use qwen36::sampling::{DegenerationConfig, RepetitionDetector};
use qwen36::{GenerateOptions, Generator};
use qwen36_testutil::{bundled_dir, bundled_reference, fixture_dir, ids_of};

fn failed<'a>(checks: &'a [Check], name: &str) -> &'a Check {
    checks
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no check {name:?} in {checks:#?}"))
}

fn options() -> DoctorOptions {
    DoctorOptions {
        generate_tokens: 64,
        ..DoctorOptions::default()
    }
}

/// The clean models pass every check (warnings allowed: the fixtures have no tokenizer and
/// random weights, whose greedy output may loop).
#[test]
fn the_doctor_passes_the_bundled_model_and_the_fixtures() {
    for dir in [
        bundled_dir(),
        fixture_dir("tiny-flat"),
        fixture_dir("tiny-nested"),
    ] {
        let report = examine(&dir, &options()).unwrap();
        eprint!("{}", report.render());
        assert!(!report.failed(), "{}", report.render());
        let json = report.to_json();
        assert_eq!(json["failed"], false);
        assert!(json["checks"].as_array().unwrap().len() >= 12);
    }
}

fn model(dir: &Path, fault: Option<Fault>) -> Qwen36Model {
    let m = Qwen36Model::load(dir, LoadOptions::default()).unwrap();
    match fault {
        Some(f) => m.with_fault(f),
        None => m,
    }
}

fn prompt(vocab: usize) -> Vec<u32> {
    (0..80u32).map(|i| (i * 7919 + 13) % vocab as u32).collect()
}

/// A bf16 GDN state: the layer comparison over decode steps names a GDN layer before any
/// attention layer and points at the state.
#[test]
fn a_bf16_gdn_state_is_found_at_the_first_gdn_layer() {
    let dir = bundled_dir();
    let (sick, clean) = (model(&dir, Some(Fault::Bf16State)), model(&dir, None));
    let checks = numerics_checks(&sick, &clean, &prompt(4096));
    let c = failed(&checks, "layers against the CPU f32 reference");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    // Layers 0-2 are GDN, 3 attention: a rounded state shows before any attention layer.
    assert!(
        ["layer 0 (GDN)", "layer 1 (GDN)", "layer 2 (GDN)"]
            .iter()
            .any(|l| c.detail.starts_with(l)),
        "{c:?}"
    );
    assert!(c.advice.contains("recurrent state must be f32"), "{c:?}");
    // The clean model against itself passes.
    let checks = numerics_checks(&clean, &clean, &prompt(4096));
    assert!(checks.iter().all(|c| c.status == Status::Pass), "{checks:#?}");
}

/// A state not reset between sequences: the reset check fails naming it.
#[test]
fn a_state_not_reset_is_found() {
    let dir = fixture_dir("tiny-flat");
    let (sick, clean) = (model(&dir, Some(Fault::NoReset)), model(&dir, None));
    let checks = numerics_checks(&sick, &clean, &prompt(384));
    let c = failed(&checks, "state reset between sequences");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.advice.contains("not reset"), "{c:?}");
    // Everything else about this model is right.
    assert!(
        checks.iter().filter(|c| c.status == Status::Fail).count() == 1,
        "{checks:#?}"
    );
}

/// A wrong rollback after a verify: the rollback check fails, and MTP greedy parts from plain
/// greedy.
#[test]
fn a_wrong_rollback_is_found() {
    let dir = bundled_dir();
    let sick = model(&dir, Some(Fault::WrongRollback));
    let head = MtpHead::load_dir(&dir, sick.config(), LoadOptions::default()).unwrap();
    let checks = speculation_checks(&sick, Some(&head), &prompt(4096)[..16], 64);
    let c = failed(&checks, "rollback after a verify");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.advice.contains("last accepted token"), "{c:?}");
    let c = failed(&checks, "MTP greedy = plain greedy");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.detail.contains("part at token"), "{c:?}");
}

/// Norm weights shifted by +1 (a plain-RMSNorm conversion): the convention check fails.
#[test]
fn norms_shifted_by_one_are_found() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_dir("tiny-flat");
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let path = dir.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    for (name, t) in tensors.iter_mut() {
        let one_plus = [
            "input_layernorm",
            "post_attention_layernorm",
            "q_norm",
            "k_norm",
            "model.norm",
        ];
        if one_plus.iter().any(|n| name.contains(n)) && !name.contains("linear_attn") {
            *t = (&*t + 1.0).unwrap();
        }
    }
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let checks = convention_checks(dir.path());
    let c = failed(&checks, "(1+w) RMSNorm weights");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.advice.contains("1+w"), "{c:?}");
    // The original passes.
    let c = convention_checks(&src);
    assert!(c.iter().all(|c| c.status == Status::Pass), "{c:#?}");
}

/// The repetition detector's false positives and detections: quiet on 2,048 held-out tokens and
/// on the bundled model's samples at its default sampling (8 × 256 tokens); fires on the
/// looping greedy output of the bundled model and on synthetic loops.
#[test]
fn the_repetition_detector_is_quiet_on_normal_text_and_fires_on_loops() {
    let cfg = DegenerationConfig::default();
    let heldout = ids_of(&bundled_reference()["heldout.ids"]);
    let mut d = RepetitionDetector::new(cfg);
    let hits = heldout.iter().filter(|&&t| d.observe(t, None).is_some()).count();
    assert_eq!(
        hits,
        0,
        "{hits} detections over {} held-out tokens",
        heldout.len()
    );
    let g = Generator::load(bundled_dir(), LoadOptions::default()).unwrap();
    let prompts = [
        "def fibonacci(n):",
        "import os\n",
        "class Parser:",
        "# Utilities\n",
    ];
    let mut sampled = 0;
    for (i, p) in prompts.iter().enumerate() {
        for seed in 0..2 {
            let opts = GenerateOptions {
                max_new_tokens: 256,
                stop_token_ids: Some(Vec::new()),
                sampling: g
                    .generation_config()
                    .sampling
                    .clone()
                    .map(|s| qwen36::SamplingParams {
                        seed: (i * 2 + seed) as u64,
                        ..s
                    }),
                ..GenerateOptions::default()
            };
            let out = g.generate_text(p, &opts, |_| {}).unwrap();
            sampled += out.tokens.len();
            assert_eq!(out.degeneration, None, "{p:?} seed {seed}: {:?}", out.text);
        }
    }
    eprintln!(
        "no detection over {} held-out and {sampled} sampled tokens",
        heldout.len()
    );
    // Greedy without penalties on this model loops, and stopping on it ends generation there.
    let opts = GenerateOptions {
        max_new_tokens: 256,
        stop_token_ids: Some(Vec::new()),
        sampling: Some(qwen36::SamplingParams::greedy()),
        stop_on_degeneration: true,
        ..GenerateOptions::default()
    };
    let out = g.generate_text("import numpy as np\n", &opts, |_| {}).unwrap();
    assert!(
        matches!(out.stop_reason, qwen36::StopReason::Degenerate(_)),
        "{:?} {:?}",
        out.stop_reason,
        out.text
    );
    assert!(out.tokens.len() < 256);
}
