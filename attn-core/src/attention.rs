//! The attention interface every backend implements: [`Attention`] computes dilated
//! attention (forward and exact backward) over strided views, for self- and
//! cross-attention, and says where its query rows sit in the global sequence.
//!
//! The float64 [`ReferenceBackend`](crate::reference::ReferenceBackend) implements it
//! here; the CPU and CUDA kernels implement it in `attn-kernels` and the ring in
//! `attn-ring`, so a layer, a conformance runner or a binding written against
//! `&dyn Attention<T>` runs on any of them.

use std::fmt::Debug;

use crate::config::DilatedConfig;
use crate::element::Element;
use crate::error::{AttnError, Result, TensorName};
pub use crate::feature::Feature;
use crate::masks::{KeyPadding, Masks, PackedSequences};
use crate::shape::AttnShape;
use crate::view::{TensorView, TensorViewMut};

/// Where the query rows of a call sit in the global sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The rows are the whole sequence, positions `0..seq`, on this device.
    Whole,
    /// The rows are rank `rank`'s share of a sequence split over `world` ranks; their
    /// global positions come from [`Attention::query_positions`].
    Shard { rank: usize, world: usize },
}

impl Placement {
    /// Whether the call sees the whole sequence.
    pub fn is_whole(self) -> bool {
        self == Placement::Whole
    }
}

/// Which pass a workspace query is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Forward,
    /// The backward pass (which also recomputes what it needs of the forward).
    Backward,
}

/// The inputs of one call: the config, the q, k, v views (`[batch, seq, heads,
/// head_dim]`; k and v may have their own sequence length for cross-attention and
/// fewer heads for grouped-query attention) and the call's [`Masks`] (key padding,
/// packed sequences; none by default).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct AttnInputs<'a, T> {
    pub cfg: &'a DilatedConfig,
    pub q: TensorView<'a, T>,
    pub k: TensorView<'a, T>,
    pub v: TensorView<'a, T>,
    pub masks: Masks<'a>,
}

impl<'a, T: Element> AttnInputs<'a, T> {
    pub fn new(cfg: &'a DilatedConfig, q: TensorView<'a, T>, k: TensorView<'a, T>, v: TensorView<'a, T>) -> Self {
        AttnInputs { cfg, q, k, v, masks: Masks::default() }
    }

    /// These inputs with a key padding mask (`[batch, key_seq]`, `true` = padding).
    pub fn with_key_padding(mut self, mask: KeyPadding<'a>) -> Self {
        self.masks.key_padding = Some(mask);
        self
    }

    /// These inputs as packed variable-length sequences (batch 1, self-attention).
    pub fn with_packing(mut self, packing: PackedSequences<'a>) -> Self {
        self.masks.packing = Some(packing);
        self
    }

    /// These inputs with the given masks.
    pub fn with_masks(mut self, masks: Masks<'a>) -> Self {
        self.masks = masks;
        self
    }

    /// Inputs from row-major buffers: q of `shape.q`, k and v of `shape.kv`.
    pub fn contiguous(cfg: &'a DilatedConfig, shape: AttnShape, [q, k, v]: [&'a [T]; 3]) -> Result<Self> {
        Ok(AttnInputs {
            cfg,
            q: TensorView::contiguous(TensorName::Query, q, shape.q)?,
            k: TensorView::contiguous(TensorName::Key, k, shape.kv)?,
            v: TensorView::contiguous(TensorName::Value, v, shape.kv)?,
            masks: Masks::default(),
        })
    }

    /// The checked shapes of q, k and v, with the config's head rule and the masks
    /// checked against them.
    pub fn shape(&self) -> Result<AttnShape> {
        let [q, k, v] = [&self.q, &self.k, &self.v].map(|x| x.shape().dims());
        let shape = AttnShape::of_call(self.cfg, [&q[..], &k[..], &v[..]])?;
        self.masks.check(&shape)?;
        Ok(shape)
    }
}

/// The set of [`Feature`]s a backend computes. A backend checks each call's inputs
/// against its set ([`AttnInputs::shape_for`]), so a call using a feature outside it is
/// [`AttnError::Unsupported`] naming the backend and the feature, never computed as
/// something else. A feature is in a backend's set only where the backend lists it
/// (block masks: in the [`Supported::ALL`] of the reference, the CPU and the CUDA kernels).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Supported(u16);

impl Supported {
    /// Dilated attention only.
    pub const NONE: Supported = Supported(0);
    /// Every feature of [`Feature::CHECKED`] (the reference computes them all).
    pub const ALL: Supported = Supported::of(&Feature::CHECKED);
    /// Every feature but block masks: what a backend computing whole key rows declares.
    pub const ALL_BUT_BLOCK_MASKS: Supported = Supported::ALL.without(Feature::BlockMask);

    /// The set of `features` ([`Feature::Other`] adds nothing).
    pub const fn of(features: &[Feature]) -> Self {
        let (mut bits, mut i) = (0, 0);
        while i < features.len() {
            bits |= features[i].bit();
            i += 1;
        }
        Supported(bits)
    }

    /// This set without `feature`.
    pub const fn without(self, feature: Feature) -> Self {
        Supported(self.0 & !feature.bit())
    }

    /// Whether the set holds `feature` (never for [`Feature::Other`]).
    pub const fn contains(self, feature: Feature) -> bool {
        let bit = feature.bit();
        bit != 0 && self.0 & bit == bit
    }

    /// `Ok` when every used feature is in the set, else [`AttnError::Unsupported`] naming
    /// `backend` and the first feature outside it.
    pub fn check(self, backend: &'static str, used: impl IntoIterator<Item = Feature>) -> Result<()> {
        match used.into_iter().find(|&f| !self.contains(f)) {
            Some(feature) => Err(AttnError::Unsupported { backend, feature }),
            None => Ok(()),
        }
    }
}

impl Debug for Supported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(Feature::CHECKED.iter().filter(|&&x| self.contains(x))).finish()
    }
}

impl<T: Element> AttnInputs<'_, T> {
    /// The features these inputs use on their checked `shape`, in [`Feature::CHECKED`] order.
    pub fn features(&self, shape: &AttnShape) -> impl Iterator<Item = Feature> + use<T> {
        let used = [
            shape.is_grouped(),
            self.masks.key_padding.is_some(),
            self.masks.packing.is_some(),
            self.cfg.window().is_some(),
            shape.kv.seq != shape.q.seq,
            self.masks.block.is_some(),
        ];
        Feature::CHECKED.into_iter().zip(used).filter_map(|(f, u)| u.then_some(f))
    }

    /// [`AttnInputs::shape`], refusing the features outside the set `supported` of
    /// `backend`.
    pub fn shape_for(&self, backend: &'static str, supported: Supported) -> Result<AttnShape> {
        let shape = self.shape()?;
        supported.check(backend, self.features(&shape))?;
        Ok(shape)
    }
}

/// What the forward produced that the backward reads: the output and its LSE
/// (`[batch, q_seq, heads]`).
#[derive(Debug, Clone, Copy)]
pub struct Saved<'a, T> {
    pub out: TensorView<'a, T>,
    pub lse: &'a [f32],
}

/// The gradient views a backward writes (it overwrites, never accumulates): `dq` of q's
/// shape, `dk` and `dv` of k's.
#[derive(Debug)]
pub struct Grads<'a, T> {
    pub dq: TensorViewMut<'a, T>,
    pub dk: TensorViewMut<'a, T>,
    pub dv: TensorViewMut<'a, T>,
}

impl<'a, T: Element> Grads<'a, T> {
    /// Gradient views over row-major buffers: `dq` of `shape.q`, `dk` and `dv` of `shape.kv`.
    pub fn contiguous(shape: AttnShape, [dq, dk, dv]: [&'a mut [T]; 3]) -> Result<Self> {
        Ok(Grads {
            dq: TensorViewMut::contiguous(TensorName::GradQuery, dq, shape.q)?,
            dk: TensorViewMut::contiguous(TensorName::GradKey, dk, shape.kv)?,
            dv: TensorViewMut::contiguous(TensorName::GradValue, dv, shape.kv)?,
        })
    }
}

/// Dilated attention as the definition gives it, forward and exact backward.
///
/// `forward` writes `out` (q's shape) and `lse` (`[batch, q_seq, heads]`); `backward`
/// writes the gradients of `sum(out * grad_out)`, and `backward_with_lse_grad` those of
/// `sum(out * grad_out) + sum(lse * grad_lse)`. Bad input is an `AttnError`, and a
/// call that fails writes nothing a caller should read.
pub trait Attention<T: Element>: Send + Sync + Debug {
    /// A short name for reports (`reference`, `cpu`, `cuda`, `ring`).
    fn name(&self) -> &str;

    /// Where this backend's query rows sit in the global sequence.
    fn placement(&self) -> Placement {
        Placement::Whole
    }

    /// The global positions of the `local_seq` query rows a caller passes (ascending),
    /// which position-dependent steps such as dropout masks use.
    fn query_positions(&self, local_seq: usize) -> Result<Vec<usize>> {
        Ok((0..local_seq).collect())
    }

    fn forward(&self, inputs: &AttnInputs<'_, T>, out: TensorViewMut<'_, T>, lse: &mut [f32]) -> Result<()>;

    /// The gradients of `sum(out * grad_out)`: [`Attention::backward_with_lse_grad`] with
    /// no gradient into the LSE.
    fn backward(
        &self,
        inputs: &AttnInputs<'_, T>,
        saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grads: Grads<'_, T>,
    ) -> Result<()> {
        self.backward_with_lse_grad(inputs, saved, grad_out, None, grads)
    }

    /// The gradients of `sum(out * grad_out) + sum(lse * grad_lse)`, for callers whose loss
    /// also uses the LSE the forward returned (partial results merged by their LSEs).
    /// `grad_lse` is laid out like the LSE (`[batch, q_seq, heads]`, this rank's rows);
    /// rows whose LSE is `-inf` take none of it. `None` is the plain backward.
    fn backward_with_lse_grad(
        &self,
        inputs: &AttnInputs<'_, T>,
        saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grad_lse: Option<&[f32]>,
        grads: Grads<'_, T>,
    ) -> Result<()>;

    /// An upper bound on the bytes a call of `pass` on `shape` without packed sequences
    /// allocates beyond its inputs and outputs (saturating at `usize::MAX`).
    fn workspace_bytes(&self, cfg: &DilatedConfig, shape: AttnShape, pass: Pass) -> usize;

    /// [`Attention::workspace_bytes`] for a call with `masks` (packed sequences may add
    /// per-sequence bookkeeping).
    fn workspace_bytes_masked(&self, cfg: &DilatedConfig, shape: AttnShape, masks: &Masks<'_>, pass: Pass) -> usize {
        let _ = masks;
        self.workspace_bytes(cfg, shape, pass)
    }
}
