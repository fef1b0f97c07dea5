//! The high-level generator on the HF fixture models.

mod common;

use std::path::PathBuf;

use candle_core::DType;
use common::*;
use qwen36::{GenerateOptions, Generator, SamplingParams, StopReason};

#[test]
fn greedy_generation_matches_hf_and_stops_on_stop_ids() {
    let g = load_generator(fixture_dir("tiny-nested"));
    let prompt = fixture_ids("tiny-nested", "prompt1.ids");
    let want = fixture_ids("tiny-nested", "prompt1.greedy");
    let opts = GenerateOptions {
        max_new_tokens: want.len(),
        sampling: Some(SamplingParams::greedy()),
        ..Default::default()
    };
    let mut streamed = Vec::new();
    let out = g.generate(&prompt, &opts, |ev| streamed.push(ev.token)).unwrap();
    assert_eq!(out.tokens, want);
    assert_eq!(streamed, want);
    assert_eq!(out.stop_reason, StopReason::MaxTokens);
    assert!(out.text.is_none(), "fixture has no tokenizer");

    // Stop on the 10th greedy token: output ends with it.
    let stop = want[9];
    let first = want.iter().position(|&t| t == stop).unwrap();
    let out = g
        .generate(
            &prompt,
            &GenerateOptions {
                stop_token_ids: Some(vec![stop]),
                ..opts.clone()
            },
            |_| {},
        )
        .unwrap();
    assert_eq!(out.tokens, want[..=first]);
    assert_eq!(out.stop_reason, StopReason::StopToken(stop));
}

#[test]
fn sampled_generation_is_reproducible_by_seed() {
    // tiny-nested spreads logits over ~10 units (tiny-flat over ~50: sampling there is near-greedy).
    let g = load_generator(fixture_dir("tiny-nested"));
    let run = |seed| {
        let s = SamplingParams {
            temperature: 1.5,
            top_p: 0.95,
            top_k: 50,
            seed,
            ..Default::default()
        };
        let opts = GenerateOptions {
            max_new_tokens: 30,
            sampling: Some(s),
            ..Default::default()
        };
        g.generate(&[1, 2, 3], &opts, |_| {}).unwrap().tokens
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

#[test]
fn text_prompt_without_tokenizer_is_an_error() {
    let g = load_generator(fixture_dir("tiny-flat"));
    let e = g
        .generate_text("hello", &GenerateOptions::default(), |_| {})
        .unwrap_err();
    assert!(matches!(e, qwen36::Error::NoTokenizer(_)), "{e}");
}

#[test]
fn speculative_generation_equals_plain_greedy() {
    use qwen36::{DrafterKind, Speculative};
    let g = load_generator(fixture_dir("tiny-nested"));
    assert!(g.mtp_head().is_some());
    let prompt = fixture_ids("tiny-nested", "prompt1.ids");
    let base = GenerateOptions {
        max_new_tokens: 60,
        sampling: Some(SamplingParams::greedy()),
        stop_token_ids: Some(vec![]),
        ..Default::default()
    };
    let plain = g.generate(&prompt, &base, |_| {}).unwrap();
    for drafter in [DrafterKind::Mtp, DrafterKind::Ngram] {
        for fixed_k in [false, true] {
            let opts = GenerateOptions {
                speculative: Some(Speculative {
                    k: 3,
                    drafter,
                    draft_vocab: None,
                    fixed_k,
                }),
                ..base.clone()
            };
            let mut streamed = Vec::new();
            let out = g.generate(&prompt, &opts, |ev| streamed.push(ev.token)).unwrap();
            let what = format!("{drafter:?}, fixed k {fixed_k}");
            assert_eq!(out.tokens, plain.tokens, "{what}");
            assert_eq!(streamed, plain.tokens);
            let stats = out.spec_stats.unwrap();
            assert!(stats.reached[0] > 0, "{what}: no drafts verified");
            // Every pass after the prefill's token emits its accepted drafts and one more.
            assert_eq!(stats.emitted, out.tokens.len() - 1, "{what}: {stats:?}");
            if fixed_k && drafter == DrafterKind::Mtp {
                // The MTP head always drafts: only the last pass (one token left) has none.
                assert!(stats.cycles - stats.reached[0] <= 1, "{what}: {stats:?}");
            }
        }
    }
}

#[test]
fn mtp_without_head_is_a_typed_error() {
    use qwen36::{DrafterKind, Speculative};
    let dir = tempfile_dir();
    let g = load_generator(&dir);
    let opts = GenerateOptions {
        speculative: Some(Speculative {
            k: 2,
            drafter: DrafterKind::Mtp,
            draft_vocab: None,
            fixed_k: false,
        }),
        ..Default::default()
    };
    let e = g.generate(&[1, 2], &opts, |_| {}).unwrap_err();
    assert!(
        matches!(e, qwen36::Error::Model(qwen36::model::Error::NoMtpHead)),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// tiny-flat without its `mtp.*` tensors, in a fresh temp dir.
fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("qwen36-nomtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture_dir("tiny-flat").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let mut map = load_tensors(fixture_dir("tiny-flat").join("model.safetensors"));
    map.retain(|k, _| !k.starts_with("mtp."));
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn kept_caches_start_each_generation_fresh() {
    use qwen36::{DrafterKind, Speculative};
    let g = load_generator(fixture_dir("tiny-nested"));
    let prompt = fixture_ids("tiny-nested", "prompt1.ids");
    let want = fixture_ids("tiny-nested", "prompt1.greedy");
    // A longer, different sequence in between (its KV buffers grow): nothing of it may leak.
    let other: Vec<u32> = prompt.iter().rev().chain(&prompt).copied().collect();
    let greedy = GenerateOptions {
        max_new_tokens: want.len(),
        sampling: Some(SamplingParams::greedy()),
        ..Default::default()
    };
    for speculative in [
        None,
        Some(Speculative {
            k: 3,
            drafter: DrafterKind::Mtp,
            draft_vocab: None,
            fixed_k: false,
        }),
        Some(Speculative {
            k: 3,
            drafter: DrafterKind::Mtp,
            draft_vocab: Some(100),
            fixed_k: false,
        }),
    ] {
        let opts = GenerateOptions {
            speculative,
            ..greedy.clone()
        };
        g.generate(&other, &opts, |_| {}).unwrap();
        assert_eq!(
            g.generate(&prompt, &opts, |_| {}).unwrap().tokens,
            want,
            "{speculative:?}"
        );
    }
}

/// The context caps a generation: the output stops where the sequence fills
/// `max_position_embeddings` (ContextFull), a request that fits exactly ends at its
/// `max_new_tokens`, and a prompt longer than the context is a typed error.
#[test]
fn the_context_caps_generation() {
    let g = load_generator(fixture_dir("tiny-nested"));
    let context = g.model().config().max_position_embeddings;
    let mut rng = qwen36_testutil::Rng::new(5);
    let prompt: Vec<u32> = (0..context - 20).map(|_| rng.below(384) as u32).collect();
    let opts = |max_new_tokens| GenerateOptions {
        max_new_tokens,
        sampling: Some(SamplingParams::greedy()),
        stop_token_ids: Some(vec![]),
        ..Default::default()
    };
    // Room for 21 tokens: the last one generated is never run.
    let full = g.generate(&prompt, &opts(100), |_| {}).unwrap();
    assert_eq!(full.tokens.len(), 21);
    assert_eq!(full.stop_reason, StopReason::ContextFull);
    let exact = g.generate(&prompt, &opts(21), |_| {}).unwrap();
    assert_eq!(exact.tokens, full.tokens);
    assert_eq!(exact.stop_reason, StopReason::MaxTokens);
    let long: Vec<u32> = (0..=context as u32).map(|i| i % 384).collect();
    // (Also with no tokens to generate: the prompt's checks come first.)
    for n in [4, 0] {
        let e = g.generate(&long, &opts(n), |_| {}).unwrap_err();
        assert!(
            matches!(e, qwen36::Error::Engine(qwen36::engine::Error::TooLong { .. })),
            "{n}: {e}"
        );
    }
    for bad in [vec![], vec![u32::MAX]] {
        let e = g.generate(&bad, &opts(0), |_| {}).unwrap_err();
        assert!(
            matches!(e, qwen36::Error::Engine(qwen36::engine::Error::Request(_))),
            "{e}"
        );
    }
    // A request of no tokens gets every check a longer one gets: sampling, stop ids.
    let nan = GenerateOptions {
        sampling: Some(SamplingParams {
            temperature: f32::NAN,
            ..SamplingParams::greedy()
        }),
        ..opts(0)
    };
    let far = GenerateOptions {
        stop_token_ids: Some(vec![u32::MAX]),
        ..opts(0)
    };
    for (o, says) in [(nan, "temperature"), (far, "stop token")] {
        let e = g.generate(&prompt, &o, |_| {}).unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
    }
    assert!(g.generate(&prompt, &opts(0), |_| {}).unwrap().tokens.is_empty());
    // Stop strings need text: without a tokenizer they are refused, not ignored.
    let e = g
        .generate(
            &prompt[..8],
            &GenerateOptions {
                stop_strings: vec!["x".into()],
                ..opts(4)
            },
            |_| {},
        )
        .unwrap_err();
    assert!(e.to_string().contains("detokenizer"), "{e}");
}

/// A request longer than the kept engine's KV pool gets a bigger one (and a short request after
/// it the same tokens as before).
#[test]
fn a_longer_request_grows_the_pool() {
    let g = load_generator(bundled_dir());
    let opts = GenerateOptions {
        max_new_tokens: 24,
        sampling: Some(SamplingParams::greedy()),
        stop_token_ids: Some(vec![]),
        ..Default::default()
    };
    let pool = |g: &qwen36::Generator| {
        let c = g.kept_engine_config().expect("an engine is kept");
        c.kv_blocks.unwrap() * c.block_size
    };
    let short = g.generate(&[5, 6, 7], &opts, |_| {}).unwrap();
    assert_eq!(pool(&g), 1024);
    // One sequence slot, no prefix cache, prompts up to 8192 tokens in one forward.
    let c = g.kept_engine_config().unwrap();
    assert_eq!((c.max_seqs, c.prefix_snapshots, c.step_tokens), (1, 0, 8192));
    // Past the smallest pool (1024 positions) that the first request made.
    let long: Vec<u32> = (0..1500u32).map(|i| 3 + (i * 7919) % 4000).collect();
    let out = g.generate(&long, &opts, |_| {}).unwrap();
    assert_eq!(out.tokens.len(), 24);
    assert_eq!(pool(&g), 2048);
    // The bigger pool is kept for what fits in it.
    assert_eq!(
        g.generate(&[5, 6, 7], &opts, |_| {}).unwrap().tokens,
        short.tokens
    );
    assert_eq!(pool(&g), 2048);
    // An MTP request keeps an engine of its draft vocabulary and choice of k; a plain one
    // takes any.
    use qwen36::{DrafterKind, Speculative};
    let mtp = |draft_vocab| GenerateOptions {
        speculative: Some(Speculative {
            k: 2,
            drafter: DrafterKind::Mtp,
            draft_vocab,
            fixed_k: true,
        }),
        ..opts.clone()
    };
    for vocab in [Some(512), Some(512), None] {
        assert_eq!(
            g.generate(&[5, 6, 7], &mtp(vocab), |_| {}).unwrap().tokens,
            short.tokens
        );
        let c = g.kept_engine_config().unwrap();
        assert_eq!((c.draft_vocab, c.adaptive_k), (vocab, false), "{vocab:?}");
    }
    g.generate(&[5, 6, 7], &opts, |_| {}).unwrap();
    let c = g.kept_engine_config().unwrap();
    assert_eq!((c.draft_vocab, c.adaptive_k), (None, false));
}

/// Speculation that ends exactly at a pool's last position: a request of 1000 prompt tokens
/// and 25 more fills its 1024-position pool, and drafting k = 3 in every round still gives all
/// 25 tokens (a verify never asks for a position past `prompt + max_tokens − 1`).
#[test]
fn speculation_fills_the_pool_to_its_last_position() {
    use qwen36::{DrafterKind, Speculative};
    let g = load_generator(bundled_dir());
    let prompt: Vec<u32> = (0..1000u32).map(|i| 3 + (i * 7919) % 4000).collect();
    let opts = GenerateOptions {
        max_new_tokens: 25,
        sampling: Some(SamplingParams::greedy()),
        stop_token_ids: Some(vec![]),
        speculative: Some(Speculative {
            k: 3,
            drafter: DrafterKind::Mtp,
            draft_vocab: None,
            fixed_k: true,
        }),
        ..Default::default()
    };
    let out = g.generate(&prompt, &opts, |_| {}).unwrap();
    assert_eq!((out.tokens.len(), &out.stop_reason), (25, &StopReason::MaxTokens));
    let plain = g
        .generate(
            &prompt,
            &GenerateOptions {
                speculative: None,
                ..opts
            },
            |_| {},
        )
        .unwrap();
    assert_eq!(out.tokens, plain.tokens);
}

/// generation_config.json: the stop ids and, with `do_sample`, every sampling field it sets
/// (the bundled model's); without `do_sample` no sampling; a malformed file names itself.
#[test]
fn generation_config_reads_its_fields() {
    use qwen36::GenerationConfig;
    let c = GenerationConfig::from_file(&bundled_dir().join("generation_config.json")).unwrap();
    assert_eq!(c.eos_token_ids, [2, 0]);
    let s = c.sampling.expect("do_sample is true");
    assert_eq!(
        (s.temperature, s.top_k, s.top_p, s.repetition_penalty),
        (0.7, 20, 0.9, 1.2)
    );
    assert_eq!((s.min_p, s.presence_penalty), (0.0, 0.0));
    let dir = std::env::temp_dir().join(format!("qwen36-genconf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("generation_config.json");
    std::fs::write(
        &path,
        r#"{"eos_token_id": 7, "do_sample": true, "min_p": 0.05, "presence_penalty": 1.5}"#,
    )
    .unwrap();
    let c = GenerationConfig::from_file(&path).unwrap();
    assert_eq!(c.eos_token_ids, [7]);
    let s = c.sampling.unwrap();
    assert_eq!(
        (s.temperature, s.top_k, s.top_p),
        (1.0, 0, 1.0),
        "unset fields: transformers' defaults"
    );
    assert_eq!((s.min_p, s.presence_penalty), (0.05, 1.5));
    std::fs::write(&path, r#"{"eos_token_id": 7, "temperature": 0.5}"#).unwrap();
    assert_eq!(GenerationConfig::from_file(&path).unwrap().sampling, None);
    std::fs::write(&path, r#"{"eos_token_id": "x"}"#).unwrap();
    let e = GenerationConfig::from_file(&path).unwrap_err().to_string();
    assert!(
        e.contains("generation_config.json") && e.contains("eos_token_id"),
        "{e}"
    );
    // Wrong types are errors, not defaults (a string temperature sampled at 1.0, a string
    // do_sample decoded greedily), as are ids past u32 (they wrapped to 0), ranges checked
    // where the file can be named, and a root that is not an object.
    for (body, says) in [
        (r#"{"do_sample": true, "temperature": "0.6"}"#, "temperature"),
        (r#"{"do_sample": true, "top_k": "20"}"#, "top_k"),
        (r#"{"do_sample": true, "top_k": 2.5}"#, "top_k"),
        (r#"{"do_sample": "true"}"#, "do_sample"),
        (r#"{"do_sample": true, "top_p": 0}"#, "top_p"),
        (r#"{"eos_token_id": 4294967296}"#, "eos_token_id"),
        (r#"{"eos_token_id": [2, 4294967297]}"#, "eos_token_id"),
        ("[]", "object"),
    ] {
        std::fs::write(&path, body).unwrap();
        let e = GenerationConfig::from_file(&path).unwrap_err().to_string();
        assert!(
            e.contains("generation_config.json") && e.contains(says),
            "{body}: {e}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The bundled model's files but `file`, linked into a fresh directory.
fn bundled_without(file: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(bundled_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != file {
            std::os::unix::fs::symlink(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    dir
}

/// A generation_config.json stop id past the vocabulary is refused by name (generation never
/// stopped at the end of a turn).
#[test]
fn a_generation_config_stop_id_past_the_vocabulary_is_refused() {
    let dir = bundled_without("generation_config.json");
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [2, 300000]}"#,
    )
    .unwrap();
    let Err(e) = Generator::load(dir.path(), qwen36::model::LoadOptions::default()) else {
        panic!("loaded with a stop id past the vocabulary");
    };
    let e = e.to_string();
    assert!(
        e.contains("generation_config.json") && e.contains("eos_token_id 300000"),
        "{e}"
    );
}

/// A checkpoint whose chat template does not compile is refused at load naming the file and
/// line; a template file given at load replaces it (the checkpoint's is then not compiled) and
/// renders with the checkpoint's special tokens.
#[test]
fn a_template_file_replaces_a_checkpoint_template_that_does_not_compile() {
    let dir = bundled_without("tokenizer_config.json");
    let config = std::fs::read_to_string(bundled_dir().join("tokenizer_config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&config).unwrap();
    config["chat_template"] = "{% for m in messages %}\n{{ m.content }} {% if %}".into();
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let opts = qwen36::model::LoadOptions::default;
    let Err(e) = Generator::load(dir.path(), opts()) else {
        panic!("loaded a template that does not compile");
    };
    let e = e.to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("syntax error") && e.contains(":2"),
        "{e}"
    );
    let file = dir.path().join("mine.jinja");
    std::fs::write(
        &file,
        "{{ eos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}",
    )
    .unwrap();
    let g = Generator::load_with(dir.path(), opts(), None, Some(&file)).unwrap();
    let eos = config["eos_token"].as_str().unwrap();
    let text = g
        .apply_chat_template(&[qwen36::ChatMessage::new("user", "hi")], true)
        .unwrap();
    assert_eq!(text, format!("{eos}[hi]"));
    let missing = dir.path().join("missing.jinja");
    let Err(e) = Generator::load_with(dir.path(), opts(), None, Some(&missing)) else {
        panic!("loaded a template file that does not exist");
    };
    assert!(e.to_string().contains("missing.jinja"), "{e}");
}

/// Batch invariance in half precision (issue 22), through the product's path with its default
/// kernels: the `Generator`'s MTP speculation (k = 1..3 in every round, the engine's paged pools
/// and graphs) gives plain greedy's 400 tokens in bf16 and f16 on the bundled model, whose drafts
/// are often accepted. CUDA only: on the CPU the matmul sums a verify's rows in another order
/// than one row's (model/tests/invariance.rs holds the per-token bit checks).
#[test]
fn half_precision_mtp_equals_plain_greedy() {
    use qwen36::{DrafterKind, Speculative};
    if !test_device().is_cuda() {
        eprintln!("skipped: batch invariance is a property of the CUDA kernels");
        return;
    }
    let prompt = ids_of(&bundled_reference()["prompt0.ids"]);
    for dtype in [DType::BF16, DType::F16] {
        let opts = load_options(dtype);
        let g = Generator::load(bundled_dir(), opts).unwrap();
        let base = GenerateOptions {
            max_new_tokens: 400,
            sampling: Some(SamplingParams::greedy()),
            stop_token_ids: Some(vec![]),
            ..Default::default()
        };
        let plain = g.generate(&prompt, &base, |_| {}).unwrap();
        for k in 1..=3 {
            let opts = GenerateOptions {
                speculative: Some(Speculative {
                    k,
                    drafter: DrafterKind::Mtp,
                    draft_vocab: None,
                    fixed_k: true,
                }),
                ..base.clone()
            };
            let out = g.generate(&prompt, &opts, |_| {}).unwrap();
            let first_diff = out.tokens.iter().zip(&plain.tokens).position(|(a, b)| a != b);
            assert_eq!(first_diff, None, "{dtype:?} k={k}: the outputs part");
            let stats = out.spec_stats.unwrap();
            eprintln!(
                "{dtype:?} k={k}: accepted length {:.2}",
                stats.accepted_len_mean()
            );
            assert!(stats.accepted > 0, "{dtype:?} k={k}: no draft accepted");
        }
    }
}
