//! Per-sequence GDN state: the conv window and the f32 recurrent state.

use candle_core::{DType, Device, Tensor};

use crate::{Error, GdnConfig, Result, VerifyCheckpoints};

/// The state one GDN layer carries between calls for a batch of sequences.
///
/// * `conv`: the last `K-1` raw (pre-conv) inputs, `[batch, conv_dim, K-1]`, in the activations'
///   dtype (a layer refuses a state of another);
/// * `recurrent`: `[batch, Hv, dk, dv]`, always f32.
///
/// By default tensors are replaced, never written in place, so a `clone()` is an exact snapshot
/// (cheap: it shares storage) and restoring one is an exact rollback. [`Self::set_in_place`]
/// switches to writing into the same buffers instead, which a recorded CUDA graph needs (it bakes
/// in the addresses); a clone is then no longer a snapshot.
#[derive(Debug, Clone)]
pub struct GdnState {
    conv: Tensor,
    recurrent: Tensor,
    /// Tokens seen since the last reset.
    seen: usize,
    in_place: bool,
    /// In place only: per verify length, the buffers its checkpoints are written into.
    checkpoint_buffers: Vec<VerifyCheckpoints>,
}

impl GdnState {
    /// A fresh (all-zero) state. `state_dtype` is the recurrent state's dtype requested by the
    /// model config: only f32 is accepted.
    pub fn new(
        cfg: &GdnConfig,
        batch: usize,
        conv_dtype: DType,
        state_dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if state_dtype != DType::F32 {
            return Err(Error::StateDtype(state_dtype));
        }
        Ok(Self {
            conv: Tensor::zeros((batch, cfg.conv_dim(), cfg.conv_kernel - 1), conv_dtype, device)?,
            recurrent: Tensor::zeros(
                (batch, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim),
                DType::F32,
                device,
            )?,
            seen: 0,
            in_place: false,
            checkpoint_buffers: Vec::new(),
        })
    }

    /// Builds a state from tensors (e.g. restored from elsewhere); refuses a non-f32 recurrent state
    /// and mismatched batch sizes.
    pub fn from_parts(conv: Tensor, recurrent: Tensor, seen: usize) -> Result<Self> {
        if recurrent.dtype() != DType::F32 {
            return Err(Error::StateDtype(recurrent.dtype()));
        }
        if conv.rank() != 3 || recurrent.rank() != 4 || conv.dim(0)? != recurrent.dim(0)? {
            return Err(Error::State(format!(
                "conv {:?} and recurrent {:?} must be [batch, conv_dim, K-1] and [batch, Hv, dk, dv]",
                conv.dims(),
                recurrent.dims()
            )));
        }
        Ok(Self {
            conv,
            recurrent,
            seen,
            in_place: false,
            checkpoint_buffers: Vec::new(),
        })
    }

    /// Zeroes both parts: the next call starts a new sequence.
    pub fn reset(&mut self) -> Result<()> {
        if self.in_place {
            self.conv.zero_set()?;
            self.recurrent.zero_set()?;
        } else {
            self.conv = self.conv.zeros_like()?;
            self.recurrent = self.recurrent.zeros_like()?;
        }
        self.seen = 0;
        Ok(())
    }

    /// Whether updates write into the existing buffers (see the type's docs).
    pub fn in_place(&self) -> bool {
        self.in_place
    }

    /// From now on, write every update into the current buffers (made contiguous and private to
    /// this state first), so their device addresses never change.
    pub fn set_in_place(&mut self) -> Result<()> {
        if !self.in_place {
            self.conv = self.conv.copy()?;
            self.recurrent = self.recurrent.copy()?;
            self.in_place = true;
        }
        Ok(())
    }

    /// The buffers a verify pass of `tokens` tokens on this in-place state writes its checkpoints
    /// into (made on first use, zeroed): fixed addresses, so a recorded CUDA graph's checkpoints
    /// are these buffers themselves rather than copies. `None` unless in place.
    pub fn checkpoint_buffers(&mut self, tokens: usize) -> Result<Option<VerifyCheckpoints>> {
        if !self.in_place || tokens == 0 {
            return Ok(None);
        }
        if let Some(cp) = self.checkpoint_buffers.iter().find(|cp| cp.len() == tokens) {
            return Ok(Some(cp.clone()));
        }
        let (b, c, hist) = self.conv.dims3()?;
        let (_, hv, dk, dv) = self.recurrent.dims4()?;
        let cp = VerifyCheckpoints {
            states: Tensor::zeros((b, tokens, hv, dk, dv), DType::F32, self.recurrent.device())?,
            window: Tensor::zeros((b, c, hist + tokens), self.conv.dtype(), self.conv.device())?,
            seen_before: 0,
        };
        self.checkpoint_buffers.push(cp.clone());
        Ok(Some(cp))
    }

    /// Counts `tokens` more tokens as seen: for a caller that replays a recorded update (a CUDA
    /// graph) whose host-side bookkeeping did not run.
    pub fn advance(&mut self, tokens: usize) {
        self.seen += tokens;
    }

    /// The conv window `[batch, conv_dim, K-1]`.
    pub fn conv(&self) -> &Tensor {
        &self.conv
    }

    /// The recurrent state `[batch, Hv, dk, dv]`, f32.
    pub fn recurrent(&self) -> &Tensor {
        &self.recurrent
    }

    /// Tokens consumed since the last reset.
    pub fn seen(&self) -> usize {
        self.seen
    }

    /// Keeps the first `keep` tokens (1..=len) of a verify pass: the state becomes exactly the state
    /// after token `keep - 1` of that pass, as if only those tokens had been run.
    /// Checkpoints of another batch or shape are refused, the state unchanged.
    pub fn commit(&mut self, checkpoints: &VerifyCheckpoints, keep: usize) -> Result<()> {
        let (conv, recurrent) = self.state_after(checkpoints, keep)?;
        // A plain state takes buffers of its own: views would share the checkpoints' storage
        // (buffers a caller may rewrite on the next pass) and keep all of it alive.
        let (conv, recurrent) = match self.in_place {
            true => (conv, recurrent),
            false => (conv.force_contiguous()?, recurrent.force_contiguous()?),
        };
        self.set(conv, recurrent)?;
        self.seen = checkpoints.seen_before + keep;
        Ok(())
    }

    /// Whether [`Self::commit`] of `keep` tokens of `checkpoints` would be accepted (the keep
    /// in range, the checkpoints of this state's shapes), changing nothing.
    pub fn check_commit(&self, checkpoints: &VerifyCheckpoints, keep: usize) -> Result<()> {
        self.state_after(checkpoints, keep).map(|_| ())
    }

    /// The conv window and recurrent state after `keep` tokens of `checkpoints` (views), or
    /// an error when they do not fit this state.
    fn state_after(&self, checkpoints: &VerifyCheckpoints, keep: usize) -> Result<(Tensor, Tensor)> {
        let (conv, recurrent) = checkpoints.state_after(keep)?;
        if conv.dims() != self.conv.dims()
            || conv.dtype() != self.conv.dtype()
            || recurrent.dims() != self.recurrent.dims()
        {
            return Err(Error::State(format!(
                "checkpoints of conv {:?} {:?} and recurrent {:?} do not fit this state (conv {:?} \
                 {:?}, recurrent {:?})",
                conv.dims(),
                conv.dtype(),
                recurrent.dims(),
                self.conv.dims(),
                self.conv.dtype(),
                self.recurrent.dims()
            )));
        }
        Ok((conv, recurrent))
    }

    /// The bookkeeping of [`Self::commit`] alone: for a caller that replays the commit's copies
    /// from a recorded CUDA graph (an in-place state).
    pub fn commit_replayed(&mut self, checkpoints: &VerifyCheckpoints, keep: usize) -> Result<()> {
        Self::check_keep(checkpoints, keep)?;
        self.seen = checkpoints.seen_before + keep;
        Ok(())
    }

    fn check_keep(checkpoints: &VerifyCheckpoints, keep: usize) -> Result<()> {
        let n = checkpoints.len();
        if keep == 0 || keep > n {
            return Err(Error::State(format!(
                "cannot keep {keep} of the {n} verified tokens (need 1..={n})"
            )));
        }
        Ok(())
    }

    pub(crate) fn update(&mut self, conv: Tensor, recurrent: Tensor, tokens: usize) -> Result<()> {
        debug_assert_eq!(recurrent.dtype(), DType::F32);
        self.set(conv, recurrent)?;
        self.seen += tokens;
        Ok(())
    }

    fn set(&mut self, conv: Tensor, recurrent: Tensor) -> Result<()> {
        if self.in_place {
            // A kernel that updated the buffer itself hands back the buffer: nothing to copy.
            if conv.id() != self.conv.id() {
                self.conv.slice_set(&conv.contiguous()?, 0, 0)?;
            }
            if recurrent.id() != self.recurrent.id() {
                self.recurrent.slice_set(&recurrent.contiguous()?, 0, 0)?;
            }
        } else {
            self.conv = conv.contiguous()?;
            self.recurrent = recurrent.contiguous()?;
        }
        Ok(())
    }
}
