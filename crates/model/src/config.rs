//! `Config`: the text-model fields of a `qwen3_5` config.json, flat or nested under `text_config`.

use std::path::Path;

use candle_core::DType;
use serde_json::{Map, Value};

use crate::{Error, Result};

/// The most decoder (or MTP) layers a config may declare: far above any model of the family,
/// low enough that a corrupt count is refused before anything is sized by it.
const MAX_LAYERS: usize = 4096;

/// Kind of a decoder layer's token mixer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// Gated DeltaNet (`"linear_attention"`).
    LinearAttention,
    /// Gated softmax attention (`"full_attention"`).
    FullAttention,
}

/// How a checkpoint's weights are quantized (`quantization_config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Quantization {
    /// HF FineGrainedFP8 (`quant_method: "fp8"`, e4m3, dynamic activations): linear weights in
    /// float8 e4m3 with a `weight_scale_inv` multiplier per `block` = `[out, in]` elements.
    /// Which weights are FP8 is read from each tensor's dtype in the files (the listed
    /// `modules_to_not_convert` are kept for reference).
    Fp8 {
        block: [usize; 2],
        modules_to_not_convert: Vec<String>,
    },
}

/// The text model's configuration (HF `Qwen3_5TextConfig`), with HF's defaults for absent fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    /// One entry per layer, from `layer_types`, or from `full_attention_interval` when absent.
    pub layer_types: Vec<LayerType>,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub max_position_embeddings: usize,
    /// Dtype of the GDN recurrent state (`mamba_ssm_dtype`, default float32).
    pub mamba_ssm_dtype: DType,
    /// MTP decoder layers in the checkpoint (`mtp_num_hidden_layers`, 0 when absent).
    pub mtp_num_hidden_layers: usize,
    /// `eos_token_id` of the text config (a number or a list).
    pub eos_token_ids: Vec<u32>,
    /// True when the fields were read from `text_config` (a `Qwen3_5ForConditionalGeneration` checkpoint).
    pub nested: bool,
    /// The weights' quantization (`quantization_config`, at top level or in `text_config`);
    /// `None` for unquantized checkpoints.
    pub quantization: Option<Quantization>,
}

/// Reads typed fields from a JSON object, with the field named in every error.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'static str,
}

impl Fields<'_> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
    fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        Error::Config {
            field: self.name(key),
            msg: msg.into(),
        }
    }
    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn usize_or(&self, key: &str, default: Option<usize>) -> Result<usize> {
        match self.get(key) {
            None => default.ok_or_else(|| self.err(key, "missing")),
            Some(v) => v
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| self.err(key, format!("expected a non-negative integer, found {v}"))),
        }
    }
    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(key, format!("expected a number, found {v}"))),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(key, format!("expected true or false, found {v}"))),
        }
    }
    fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a string, found {v}"))),
        }
    }
}

impl Config {
    /// Reads and parses `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&value)
    }

    /// Parses a config.json value: the text fields at top level (`Qwen3_5ForCausalLM`) or under
    /// `text_config` (`Qwen3_5ForConditionalGeneration`).
    pub fn from_json(value: &Value) -> Result<Self> {
        let top = value.as_object().ok_or_else(|| Error::Config {
            field: "<root>".into(),
            msg: "config.json must be a JSON object".into(),
        })?;
        let (obj, prefix, nested) = match top.get("text_config") {
            Some(Value::Object(tc)) => (tc, "text_config.", true),
            Some(v) if !v.is_null() => {
                return Err(Error::Config {
                    field: "text_config".into(),
                    msg: format!("expected an object, found {v}"),
                })
            }
            _ => (top, "", false),
        };
        let f = Fields { obj, prefix };
        let top_f = Fields { obj: top, prefix: "" };

        let hidden_size = f.usize_or("hidden_size", Some(4096))?;
        let num_attention_heads = f.usize_or("num_attention_heads", Some(16))?;
        let num_hidden_layers = f.usize_or("num_hidden_layers", Some(32))?;
        // (Checked before the layer list is built from it.)
        if num_hidden_layers == 0 || num_hidden_layers > MAX_LAYERS {
            return Err(f.err(
                "num_hidden_layers",
                format!("must be positive and at most {MAX_LAYERS}, found {num_hidden_layers}"),
            ));
        }
        let head_dim = f.usize_or("head_dim", Some(256))?;
        // A mixture-of-experts model of the family (`qwen3_5_moe`) has experts in place of the
        // dense MLP this model reads: refused by name, not as a missing MLP tensor.
        for key in ["num_experts", "num_local_experts"] {
            if f.get(key).and_then(Value::as_u64).is_some_and(|n| n > 0) {
                return Err(f.err(
                    key,
                    "mixture-of-experts models are not supported (dense MLPs only)",
                ));
            }
        }

        let layer_types = match f.get("layer_types") {
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(index, v)| match v.as_str() {
                    // HF's legacy names ("mamba", "attention") are remapped as transformers does.
                    Some("linear_attention") | Some("mamba") => Ok(LayerType::LinearAttention),
                    Some("full_attention") | Some("attention") => Ok(LayerType::FullAttention),
                    _ => Err(Error::UnknownLayerType {
                        index,
                        value: v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string()),
                    }),
                })
                .collect::<Result<Vec<_>>>()?,
            Some(v) => return Err(f.err("layer_types", format!("expected a list of strings, found {v}"))),
            None => {
                let interval = f.usize_or("full_attention_interval", Some(4))?;
                if interval == 0 {
                    return Err(f.err("full_attention_interval", "must be positive"));
                }
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerType::FullAttention
                        } else {
                            LayerType::LinearAttention
                        }
                    })
                    .collect()
            }
        };
        if layer_types.len() != num_hidden_layers {
            return Err(f.err(
                "layer_types",
                format!(
                    "has {} entries but num_hidden_layers is {num_hidden_layers}",
                    layer_types.len()
                ),
            ));
        }

        // RoPE: `rope_parameters` (transformers 5), else `rope_scaling` (legacy) with the
        // top-level fields. Only the default RoPE is supported: a scaling type in either key is
        // refused (one read and the other ignored would change positions past the training
        // context without a word).
        let mut rope = None;
        for key in ["rope_parameters", "rope_scaling"] {
            let obj = match f.get(key) {
                Some(Value::Object(r)) => r,
                None | Some(Value::Null) => continue,
                Some(v) => return Err(f.err(key, format!("expected an object, found {v}"))),
            };
            let rf = Fields {
                obj,
                prefix: match (nested, key) {
                    (true, "rope_parameters") => "text_config.rope_parameters.",
                    (true, _) => "text_config.rope_scaling.",
                    (false, "rope_parameters") => "rope_parameters.",
                    (false, _) => "rope_scaling.",
                },
            };
            let kind = rf
                .str_opt("rope_type")?
                .or(rf.str_opt("type")?)
                .unwrap_or("default");
            // (Multimodal RoPE is the plain one for text, whose three position ids are equal:
            // transformers reads "mrope" as "default" too.)
            if kind != "default" && kind != "mrope" {
                return Err(rf.err(
                    "rope_type",
                    format!("{kind:?} is not supported (only \"default\")"),
                ));
            }
            rope = rope.or(Some(rf));
        }
        let rf = rope;
        let rope_theta = match &rf {
            Some(rf) if rf.get("rope_theta").is_some() => rf.f64_or("rope_theta", 10_000.0)?,
            _ => f.f64_or("rope_theta", 10_000.0)?,
        };
        let partial_rotary_factor = match &rf {
            Some(rf) if rf.get("partial_rotary_factor").is_some() => {
                rf.f64_or("partial_rotary_factor", 0.25)?
            }
            _ => f.f64_or("partial_rotary_factor", 0.25)?,
        };
        // (The frequencies are computed in f32: a larger θ would be inf there.)
        if !(rope_theta > 0.0 && rope_theta <= f32::MAX as f64) {
            return Err(f.err(
                "rope_theta",
                format!("must be positive and finite in f32, found {rope_theta}"),
            ));
        }
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
            return Err(f.err(
                "partial_rotary_factor",
                format!("must be in (0, 1], found {partial_rotary_factor}"),
            ));
        }

        let mamba_ssm_dtype = match f.str_opt("mamba_ssm_dtype")? {
            None | Some("float32") | Some("fp32") => DType::F32,
            Some(other @ ("bfloat16" | "float16" | "bf16" | "fp16")) => {
                return Err(Error::StateDtype(other.into()))
            }
            Some(other) => {
                return Err(f.err(
                    "mamba_ssm_dtype",
                    format!("unknown dtype {other:?} (expected \"float32\")"),
                ))
            }
        };
        if let Some(act) = f.str_opt("hidden_act")? {
            if act != "silu" {
                return Err(f.err("hidden_act", format!("{act:?} is not supported (only \"silu\")")));
            }
        }
        let eos_token_ids = match f.get("eos_token_id") {
            None => vec![],
            Some(Value::Array(list)) => list
                .iter()
                .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| f.err("eos_token_id", "expected token ids (integers below 2^32)"))?,
            Some(v) => vec![v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| f.err("eos_token_id", format!("expected a token id, found {v}")))?],
        };
        // A nested checkpoint's top-level `tie_word_embeddings` governs the lm_head, like HF.
        let tie_default = f.bool_or("tie_word_embeddings", false)?;
        let tie_word_embeddings = if nested {
            top_f.bool_or("tie_word_embeddings", tie_default)?
        } else {
            tie_default
        };

        let cfg = Config {
            vocab_size: f.usize_or("vocab_size", Some(248_320))?,
            hidden_size,
            intermediate_size: f.usize_or("intermediate_size", Some(12_288))?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", Some(4))?,
            head_dim,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            tie_word_embeddings,
            attention_bias: f.bool_or("attention_bias", false)?,
            layer_types,
            linear_conv_kernel_dim: f.usize_or("linear_conv_kernel_dim", Some(4))?,
            linear_key_head_dim: f.usize_or("linear_key_head_dim", Some(128))?,
            linear_value_head_dim: f.usize_or("linear_value_head_dim", Some(128))?,
            linear_num_key_heads: f.usize_or("linear_num_key_heads", Some(16))?,
            linear_num_value_heads: f.usize_or("linear_num_value_heads", Some(32))?,
            rope_theta,
            partial_rotary_factor,
            max_position_embeddings: f.usize_or("max_position_embeddings", Some(32_768))?,
            mamba_ssm_dtype,
            mtp_num_hidden_layers: f.usize_or("mtp_num_hidden_layers", Some(0))?,
            eos_token_ids,
            nested,
            quantization: parse_quantization(top, obj, prefix)?,
        };
        cfg.validate(&f)?;
        Ok(cfg)
    }

    fn validate(&self, f: &Fields) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        // (The bound keeps every product of two sizes within usize.)
        for (key, v) in positive {
            if v == 0 || v > 1 << 30 {
                return Err(f.err(key, format!("must be positive and at most 2^30, found {v}")));
            }
        }
        if let Some(&id) = self
            .eos_token_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return Err(f.err(
                "eos_token_id",
                format!("{id} is outside the vocabulary of {}", self.vocab_size),
            ));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(f.err(
                "num_attention_heads",
                format!(
                    "{} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            return Err(f.err(
                "linear_num_value_heads",
                format!(
                    "{} is not a multiple of linear_num_key_heads {}",
                    self.linear_num_value_heads, self.linear_num_key_heads
                ),
            ));
        }
        if self.linear_conv_kernel_dim < 2 {
            return Err(f.err("linear_conv_kernel_dim", "must be at least 2"));
        }
        let rd = self.rotary_dim();
        if rd == 0 || rd % 2 != 0 {
            return Err(f.err(
                "partial_rotary_factor",
                format!("gives rotary dim {rd}; it must be even and positive"),
            ));
        }
        // (An ε of 1 or more would swamp the mean square of any normalised activation.)
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return Err(f.err(
                "rms_norm_eps",
                format!("must be in (0, 1), found {}", self.rms_norm_eps),
            ));
        }
        if self.mtp_num_hidden_layers > MAX_LAYERS {
            return Err(f.err(
                "mtp_num_hidden_layers",
                format!(
                    "must be at most {MAX_LAYERS}, found {}",
                    self.mtp_num_hidden_layers
                ),
            ));
        }
        Ok(())
    }

    /// Rotated dims per attention head: `head_dim · partial_rotary_factor` (64 for Qwen3.6).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// The GDN layer sizes.
    pub fn gdn(&self) -> qwen36_gdn::GdnConfig {
        qwen36_gdn::GdnConfig {
            hidden_size: self.hidden_size,
            num_k_heads: self.linear_num_key_heads,
            num_v_heads: self.linear_num_value_heads,
            k_head_dim: self.linear_key_head_dim,
            v_head_dim: self.linear_value_head_dim,
            conv_kernel: self.linear_conv_kernel_dim,
            rms_norm_eps: self.rms_norm_eps,
        }
    }
}

/// `quantization_config`, from `text_config` or the top level: only block-scaled FP8 e4m3 with
/// dynamic activation scales is supported; any other method (AWQ, GPTQ, bitsandbytes, …) or
/// variant is refused naming it, so that quantized weights are never read as plain numbers.
fn parse_quantization(
    top: &Map<String, Value>,
    text: &Map<String, Value>,
    prefix: &'static str,
) -> Result<Option<Quantization>> {
    let (q, field) = match (text.get("quantization_config"), top.get("quantization_config")) {
        (Some(q), _) if !q.is_null() && prefix == "text_config." => (q, "text_config.quantization_config"),
        (_, Some(q)) if !q.is_null() => (q, "quantization_config"),
        _ => return Ok(None),
    };
    let err = |key: &str, msg: String| Error::Config {
        field: if key.is_empty() {
            field.to_string()
        } else {
            format!("{field}.{key}")
        },
        msg,
    };
    let obj = q
        .as_object()
        .ok_or_else(|| err("", format!("expected an object, found {q}")))?;
    let text_of = |key: &str| obj.get(key).and_then(Value::as_str);
    let method =
        text_of("quant_method").ok_or_else(|| err("quant_method", "missing or not a string".into()))?;
    if method != "fp8" {
        return Err(err(
            "quant_method",
            format!("{method:?} is not supported (only \"fp8\", block-scaled e4m3): refusing to read its weights as plain numbers"),
        ));
    }
    // `fmt` is absent from some official checkpoints (e4m3 is the default).
    if let Some(fmt) = obj.get("fmt").filter(|v| !v.is_null()) {
        if fmt.as_str() != Some("e4m3") {
            return Err(err("fmt", format!("{fmt} is not supported (only \"e4m3\")")));
        }
    }
    if let Some(a) = obj.get("activation_scheme").filter(|v| !v.is_null()) {
        if a.as_str() != Some("dynamic") {
            return Err(err(
                "activation_scheme",
                format!("{a} is not supported (only \"dynamic\")"),
            ));
        }
    }
    let block = match obj.get("weight_block_size") {
        Some(Value::Array(b)) if b.len() == 2 => {
            let dims: Option<Vec<usize>> = b
                .iter()
                .map(|v| {
                    v.as_u64()
                        .filter(|&x| x > 0 && x <= i32::MAX as u64)
                        .map(|x| x as usize)
                })
                .collect();
            match dims {
                Some(d) => [d[0], d[1]],
                None => {
                    return Err(err(
                        "weight_block_size",
                        format!("{b:?}: expected two positive integers"),
                    ))
                }
            }
        }
        None | Some(Value::Null) => {
            return Err(err(
                "weight_block_size",
                "missing: per-tensor FP8 is not supported, only block-scaled weights".into(),
            ))
        }
        Some(v) => {
            return Err(err(
                "weight_block_size",
                format!("{v}: expected two positive integers"),
            ))
        }
    };
    let modules_to_not_convert = match obj
        .get("modules_to_not_convert")
        .or_else(|| obj.get("ignored_layers"))
    {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| err("modules_to_not_convert", "expected a list of strings".into()))?,
        Some(v) => {
            return Err(err(
                "modules_to_not_convert",
                format!("{v}: expected a list of strings"),
            ))
        }
    };
    Ok(Some(Quantization::Fp8 {
        block,
        modules_to_not_convert,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn interval_used_only_without_list() {
        let c = Config::from_json(&json!({"num_hidden_layers": 8, "full_attention_interval": 4})).unwrap();
        let full: Vec<usize> = (0..8)
            .filter(|&i| c.layer_types[i] == LayerType::FullAttention)
            .collect();
        assert_eq!(full, vec![3, 7]);
        let c = Config::from_json(&json!({
            "num_hidden_layers": 3, "full_attention_interval": 4,
            "layer_types": ["full_attention", "linear_attention", "full_attention"]
        }))
        .unwrap();
        assert_eq!(c.layer_types[0], LayerType::FullAttention);
        assert_eq!(c.layer_types[2], LayerType::FullAttention);
    }

    #[test]
    fn nested_text_config_and_top_level_tie() {
        let c = Config::from_json(&json!({
            "tie_word_embeddings": true,
            "text_config": {"hidden_size": 64, "num_hidden_layers": 1, "tie_word_embeddings": false,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
        }))
        .unwrap();
        assert!(c.nested && c.tie_word_embeddings);
        assert_eq!((c.hidden_size, c.rope_theta, c.rotary_dim()), (64, 1e7, 64));
    }

    #[test]
    fn bad_values_name_the_field() {
        let e = Config::from_json(
            &json!({"num_hidden_layers": 2, "layer_types": ["linear_attention", "sliding_attention"]}),
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::UnknownLayerType { index: 1, value } if value == "sliding_attention"),
            "{e}"
        );
        let e = Config::from_json(&json!({"text_config": {"mamba_ssm_dtype": "bfloat16"}})).unwrap_err();
        assert!(matches!(&e, Error::StateDtype(s) if s == "bfloat16"), "{e}");
        let e = Config::from_json(&json!({"text_config": {"hidden_size": "big"}})).unwrap_err();
        assert!(e.to_string().contains("text_config.hidden_size"), "{e}");
        let e = Config::from_json(&json!({"num_hidden_layers": 2, "layer_types": ["linear_attention"]}))
            .unwrap_err();
        assert!(e.to_string().contains("layer_types"), "{e}");
        let e = Config::from_json(&json!({"rope_parameters": {"rope_type": "yarn"}})).unwrap_err();
        assert!(e.to_string().contains("rope_type"), "{e}");
        let e = Config::from_json(&json!({"linear_num_key_heads": 16, "linear_num_value_heads": 40}))
            .unwrap_err();
        assert!(e.to_string().contains("linear_num_value_heads"), "{e}");
        // A rope base that makes every attention output NaN; ids past u32 (which once wrapped
        // to 0) or past the vocabulary (a stop that never fires); sizes whose products
        // overflow.
        for (bad, field) in [
            (json!({"rope_theta": 0.0}), "rope_theta"),
            (json!({"rope_parameters": {"rope_theta": -1.0}}), "rope_theta"),
            (json!({"eos_token_id": 4_294_967_296u64}), "eos_token_id"),
            (json!({"eos_token_id": [1, 4_294_967_297u64]}), "eos_token_id"),
            (json!({"vocab_size": 1000, "eos_token_id": 1000}), "eos_token_id"),
            (json!({"head_dim": 1u64 << 62}), "head_dim"),
            (
                json!({"max_position_embeddings": u64::MAX}),
                "max_position_embeddings",
            ),
        ] {
            let e = Config::from_json(&bad).unwrap_err();
            assert!(e.to_string().contains(field), "{bad}: {e}");
        }
        let c = Config::from_json(&json!({"vocab_size": 1000, "eos_token_id": [999]})).unwrap();
        assert_eq!(c.eos_token_ids, [999]);
    }

    /// `quantization_config` is read from `text_config` or the top level; `fmt` may be absent
    /// and `ignored_layers` names the unconverted modules; a flat config without it has none.
    #[test]
    fn fp8_quantization_config_is_found_where_checkpoints_put_it() {
        let fp8 = serde_json::json!({"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "ignored_layers": ["lm_head"]});
        let want = Some(Quantization::Fp8 {
            block: [128, 128],
            modules_to_not_convert: vec!["lm_head".into()],
        });
        let flat = serde_json::json!({"quantization_config": fp8});
        assert_eq!(Config::from_json(&flat).unwrap().quantization, want);
        let nested_top = serde_json::json!({"text_config": {}, "quantization_config": fp8});
        assert_eq!(Config::from_json(&nested_top).unwrap().quantization, want);
        let nested_in = serde_json::json!({"text_config": {"quantization_config": fp8}});
        assert_eq!(Config::from_json(&nested_in).unwrap().quantization, want);
        assert_eq!(
            Config::from_json(&serde_json::json!({})).unwrap().quantization,
            None
        );
        let bad =
            serde_json::json!({"text_config": {"quantization_config": {"quant_method": "bitsandbytes"}}});
        let e = Config::from_json(&bad).unwrap_err().to_string();
        assert!(
            e.contains("text_config.quantization_config.quant_method") && e.contains("bitsandbytes"),
            "{e}"
        );
    }
}
