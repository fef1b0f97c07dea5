//! Which part of the model each rank of a tensor-parallel group holds, as vLLM and SGLang shard
//! Qwen3.5/3.6: attention by heads (q|gate, k, v column-parallel; `o_proj` row-parallel), GDN
//! by key/value head blocks (`in_proj_qkv` and `conv1d` per q/k/v segment, `in_proj_z|b|a`,
//! `A_log`, `dt_bias` by value heads; `out_proj` row-parallel), the MLP by intermediate columns
//! (`gate|up` column-, `down` row-parallel). Embedding, norms, `lm_head` and the MTP head's `fc`
//! are replicated. A rank's config is the full one with its head counts and intermediate size;
//! the layers then load and run unchanged on their shards, and the row-parallel outputs are
//! summed over the ranks ([`crate::Communicator`]).

use std::ops::Range;

use crate::{Config, Error, Result};

/// One rank's place in a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
}

impl Shard {
    /// The heads of a group of `n` this rank holds: `n / size` consecutive ones when `size`
    /// divides `n`; otherwise (`n` divides `size`: key/value heads fewer than ranks) the one
    /// head its share of the query or value heads reads, each held by `size / n` ranks.
    pub fn heads(&self, n: usize) -> Range<usize> {
        if n % self.size == 0 {
            let per = n / self.size;
            self.rank * per..(self.rank + 1) * per
        } else {
            let h = self.rank / (self.size / n);
            h..h + 1
        }
    }
}

/// Heads each rank holds of `n`, or an error naming `field` unless `size` divides `n` (or, for
/// key/value heads, `n` divides `size`).
fn local(n: usize, size: usize, field: &str, replicable: bool) -> Result<usize> {
    if n % size == 0 {
        Ok(n / size)
    } else if replicable && size % n == 0 {
        Ok(1)
    } else {
        let what = if replicable {
            "divide it or be a multiple of it"
        } else {
            "divide it"
        };
        Err(Error::Config {
            field: field.into(),
            msg: format!(
                "{n} cannot be split over {size} tensor-parallel ranks (the rank count must {what})"
            ),
        })
    }
}

impl Config {
    /// The configuration of one rank's part of the model: its attention and GDN head counts and
    /// its intermediate size. Refused, naming the field, when the heads or the intermediate size
    /// do not split over `shard.size` ranks, and for what sharding does not cover yet
    /// (attention biases). (FP8 weights shard along their scale blocks: a rank count whose parts
    /// cut a block is refused as the weight is read, naming it.)
    pub fn shard(&self, shard: Shard) -> Result<Config> {
        let size = shard.size;
        if size == 0 || shard.rank >= size {
            return Err(Error::Config {
                field: "tensor_parallel_size".into(),
                msg: format!("rank {} of a group of {size}", shard.rank),
            });
        }
        if size == 1 {
            return Ok(self.clone());
        }
        if self.attention_bias {
            return Err(Error::Config {
                field: "attention_bias".into(),
                msg: "attention biases are not sharded for tensor parallelism".into(),
            });
        }
        let mut c = self.clone();
        c.num_attention_heads = local(self.num_attention_heads, size, "num_attention_heads", false)?;
        c.num_key_value_heads = local(self.num_key_value_heads, size, "num_key_value_heads", true)?;
        c.linear_num_value_heads = local(self.linear_num_value_heads, size, "linear_num_value_heads", false)?;
        c.linear_num_key_heads = local(self.linear_num_key_heads, size, "linear_num_key_heads", true)?;
        c.intermediate_size = local(self.intermediate_size, size, "intermediate_size", false)?;
        Ok(c)
    }
}

/// How a tensor is cut between ranks: along `dim`, consecutive segments of `(heads, width)`
/// (`heads · width` entries each); a rank keeps its heads ([`Shard::heads`]) of every segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Split {
    pub dim: usize,
    pub segments: Vec<(usize, usize)>,
}

impl Split {
    /// The full length along `dim`, and the ranges `shard` keeps, in order.
    pub fn ranges(&self, shard: Shard) -> (usize, Vec<Range<usize>>) {
        let mut at = 0;
        let mut keep = Vec::new();
        for &(heads, width) in &self.segments {
            let h = shard.heads(heads);
            keep.push(at + h.start * width..at + h.end * width);
            at += heads * width;
        }
        (at, keep)
    }
}

/// How the tensor `name` (a full tensor name) is cut under the full config `cfg`; `None`:
/// every rank holds all of it.
pub(crate) fn split_of(name: &str, cfg: &Config) -> Option<Split> {
    let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let (hk, hv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
    let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
    let qkv = vec![(hk, dk), (hk, dk), (hv, dv)];
    let rows = |segments| Some(Split { dim: 0, segments });
    let cols = |segments| Some(Split { dim: 1, segments });
    let module = name.strip_suffix(".weight").unwrap_or(name);
    let last2 = {
        let mut parts = module.rsplit('.');
        let a = parts.next().unwrap_or("");
        let b = parts.next().unwrap_or("");
        (b, a)
    };
    match last2 {
        ("self_attn", "q_proj") => rows(vec![(nh, 2 * hd)]),
        ("self_attn", "k_proj" | "v_proj") => rows(vec![(nkv, hd)]),
        ("self_attn", "o_proj") => cols(vec![(nh, hd)]),
        ("linear_attn", "in_proj_qkv" | "conv1d") => rows(qkv),
        ("linear_attn", "in_proj_z") => rows(vec![(hv, dv)]),
        ("linear_attn", "in_proj_b" | "in_proj_a" | "A_log" | "dt_bias") => rows(vec![(hv, 1)]),
        ("linear_attn", "out_proj") => cols(vec![(hv, dv)]),
        // (Intermediate columns split like heads of width 1.)
        ("mlp", "gate_proj" | "up_proj") => rows(vec![(cfg.intermediate_size, 1)]),
        ("mlp", "down_proj") => cols(vec![(cfg.intermediate_size, 1)]),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        let dir = qwen36_testutil::fixture_dir("tiny-flat");
        Config::from_file(dir.join("config.json")).unwrap()
    }

    /// Heads split evenly, or one each when ranks outnumber them (each held by several ranks,
    /// the one its share of query heads reads).
    #[test]
    fn heads_split_or_replicate() {
        let at = |rank, size, n| Shard { rank, size }.heads(n);
        assert_eq!((at(0, 2, 4), at(1, 2, 4)), (0..2, 2..4));
        assert_eq!(
            (0..4).map(|r| at(r, 4, 2)).collect::<Vec<_>>(),
            [0..1, 0..1, 1..2, 1..2]
        );
        assert_eq!(at(3, 4, 1), 0..1);
    }

    /// A rank's config divides the heads and the intermediate size; what does not split is an
    /// error naming the field.
    #[test]
    fn a_rank_config_divides_what_splits_and_names_what_does_not() {
        let full = cfg(); // 4 heads, 2 KV heads, GDN 2 key / 4 value heads, intermediate 128
        let c = full.shard(Shard { rank: 1, size: 4 }).unwrap();
        assert_eq!(
            (
                c.num_attention_heads,
                c.num_key_value_heads,
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.intermediate_size
            ),
            (1, 1, 1, 1, 32)
        );
        assert_eq!(full.shard(Shard { rank: 0, size: 1 }).unwrap(), full);
        let e = full.shard(Shard { rank: 0, size: 3 }).unwrap_err().to_string();
        assert!(e.contains("num_attention_heads") && e.contains("3"), "{e}");
        let mut odd = full.clone();
        odd.num_key_value_heads = 3;
        odd.num_attention_heads = 6;
        let e = odd.shard(Shard { rank: 0, size: 2 }).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
        let mut odd = full.clone();
        odd.intermediate_size = 130;
        let e = odd.shard(Shard { rank: 0, size: 4 }).unwrap_err().to_string();
        assert!(e.contains("intermediate_size"), "{e}");
        assert!(full.shard(Shard { rank: 2, size: 2 }).is_err());
    }

    /// The GDN projection's q, k and v segments each give the rank its heads.
    #[test]
    fn segments_keep_each_parts_heads() {
        let full = cfg(); // dk 16, dv 24
        let split = split_of("model.layers.0.linear_attn.in_proj_qkv.weight", &full).unwrap();
        let (n, keep) = split.ranges(Shard { rank: 1, size: 2 });
        assert_eq!(n, 2 * 2 * 16 + 4 * 24);
        assert_eq!(keep, [16..32, 48..64, 64 + 48..64 + 96]);
        let split = split_of("model.layers.3.self_attn.o_proj.weight", &full).unwrap();
        assert_eq!(split.dim, 1);
        let (n, keep) = split.ranges(Shard { rank: 3, size: 4 });
        assert_eq!((n, keep.len(), &keep[0]), (128, 1, &(96..128)));
        assert_eq!(split_of("model.layers.0.input_layernorm.weight", &full), None);
        assert_eq!(split_of("model.layers.0.linear_attn.norm.weight", &full), None);
        assert_eq!(split_of("lm_head.weight", &full), None);
    }
}
