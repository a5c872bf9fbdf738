//! `CpuBackend`: whole-tensor attention (dilated in both mixing modes or a sliding
//! window, causal or not, with grouped key/value heads, key padding and packed
//! sequences) on a rayon pool, forward and backward, writing straight into the caller's
//! strided views.
//!
//! Work is split into fixed units `(lane, head, position chunk)` that do not depend on
//! the thread count (a lane is a batch row or a packed sequence); each unit computes
//! all patterns of its head for its rows (LongNet merged by LSE in a unit-local f32
//! accumulator) and owns its output rows, so results are bit-identical for any number
//! of threads. The backward recomputes scores from the final LSE, either in one fused
//! pass per whole segment (units of `lcm(w_i)` positions of a key/value head own every
//! row they touch) or, for very long segments or few units, with two kinds of units:
//! query chunks (own `dq` rows) and key chunks of a key/value head (own `dk`/`dv` rows,
//! summed over the query heads reading them). See `units` and `unit_passes`.
//!
//! Unsafe here: only the disjoint row writes through [`DisjointSlice`] (see SAFETY notes).
#![allow(unsafe_code)]

use attn_core::FiniteCheck;
use attn_core::error::TensorName;
use attn_core::{Attention, AttnInputs, Grads as AttnGrads, Masks, Pass, Saved, Supported};
use attn_core::{AttnError, AttnShape, DilatedConfig, Element, Result, Shape4};
use attn_core::{MemoryBudget, TensorView, TensorViewMut, check_finite};
use rayon::prelude::*;

use crate::cpu::isa::Isa;
use crate::cpu::isa::ops::{FORWARD_KEY_TILE, FORWARD_QUERY_CHUNK, KEY_TILE, QUERY_CHUNK, padded};
use crate::cpu::schedule::disjoint::DisjointSlice;
use crate::cpu::schedule::score_bound::max_finite_abs;
use crate::cpu::schedule::unit_passes::{Grads, Scratch, dkv_unit, dq_unit, forward_unit, fused_unit};
use crate::cpu::schedule::units::{
    FUSED_MAX_UNIT, Lane, Plan, Side, Unit, chunk_len, forward_chunk_lens, forward_units, fused_unit_len, fused_units,
    lanes, longest, max_forward_chunk_len, split_units,
};
use crate::huge_pages::zeroed_buffer;

/// The CPU backend: a thread pool (built once), the kernel flavour, a memory budget
/// for the scratch a call allocates and the opt-in finite-input check.
#[derive(Debug)]
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    isa: Isa,
    budget: MemoryBudget,
    check_finite: bool,
}

/// Backward work: a query chunk (dq), a key chunk (dk, dv), or (single-pattern heads) a
/// whole segment (dq, dk and dv in one pass).
#[derive(Debug, Clone, Copy)]
enum Task {
    Dq(Unit),
    Dkv(Unit),
    Fused(Unit),
}

/// Where a unit's gradient goes: (index into the geometry list, destination, accumulator).
type Target<'s, 'a, T> = (usize, &'s DisjointSlice<'a, T>, Acc);

/// Which accumulator of [`Scratch`] holds a gradient.
#[derive(Debug, Clone, Copy)]
enum Acc {
    A,
    B,
    C,
}

fn check_same(tensor: TensorName, got: Shape4, want: Shape4) -> Result<()> {
    if got != want {
        return Err(AttnError::ShapeMismatch { tensor, expected: want.dims().to_vec(), got: got.dims().to_vec() });
    }
    Ok(())
}

fn check_len(tensor: TensorName, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(AttnError::ShapeMismatch { tensor, expected: vec![want], got: vec![got] });
    }
    Ok(())
}

impl CpuBackend {
    /// A backend with `threads` worker threads (0 = one per core) and the best kernels
    /// this CPU supports. More threads than a rayon pool can hold
    /// (`rayon::max_num_threads()`) is [`AttnError::InvalidArgument`].
    pub fn new(threads: usize) -> Result<Self> {
        if threads > rayon::max_num_threads() {
            return Err(AttnError::InvalidArgument(format!(
                "{threads} CPU threads requested; a pool holds at most {}",
                rayon::max_num_threads()
            )));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("attn-cpu-{i}"))
            .build()
            .map_err(|e| AttnError::backend("cpu", e))?;
        Ok(CpuBackend { pool, isa: Isa::detect(), budget: MemoryBudget::unlimited(), check_finite: false })
    }

    /// Refuse (with [`AttnError::OverBudget`], before allocating anything) any call whose
    /// scratch ([`CpuBackend::workspace_bytes`]) exceeds `budget`.
    pub fn with_budget(mut self, budget: MemoryBudget) -> Self {
        self.budget = budget;
        self
    }

    /// The memory budget in force.
    pub fn budget(&self) -> MemoryBudget {
        self.budget
    }

    /// With [`FiniteCheck::Inputs`], every call first checks q, k, v (and grad_out in a
    /// backward) and returns [`AttnError::NonFinite`] naming the first tensor and flat
    /// index holding a NaN or infinity, before computing or writing anything.
    pub fn with_check_finite(mut self, check: FiniteCheck) -> Self {
        self.check_finite = check == FiniteCheck::Inputs;
        self
    }

    /// Whether calls check their inputs for non-finite values.
    pub fn checks_finite(&self) -> bool {
        self.check_finite
    }

    /// Use another kernel flavour (e.g. [`Isa::Portable`] to compare paths).
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        if !isa.is_supported() {
            return Err(AttnError::BackendUnavailable {
                backend: "cpu",
                reason: format!("this CPU cannot run the {} kernels", isa.as_str()),
            });
        }
        self.isa = isa;
        Ok(self)
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// The kernel flavour in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    fn plan<'a, T: Element>(&self, inputs: &AttnInputs<'a, T>, pass: Pass) -> Result<(Plan<'a, T>, Vec<Lane>)> {
        let (cfg, q, k, v) = (inputs.cfg, inputs.q, inputs.k, inputs.v);
        let shape = inputs.shape_for("cpu", Supported::ALL)?;
        // Before anything is allocated.
        self.budget.check(self.workspace_bytes_masked(cfg, shape, &inputs.masks, pass))?;
        if self.check_finite {
            check_finite(TensorName::Query, &q)?;
            check_finite(TensorName::Key, &k)?;
            check_finite(TensorName::Value, &v)?;
        }
        let d = shape.q.head_dim;
        let scale = cfg.scale_for(d) as f32;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(AttnError::InvalidScale(cfg.scale_for(d)));
        }
        // |scale * q.k| <= scale * d * max|q| * max|k|: refuse calls whose scores could leave
        // the f32 range instead of returning NaN.
        let bound = f64::from(scale) * d as f64 * max_finite_abs(&self.pool, &q) * max_finite_abs(&self.pool, &k);
        if bound > f64::from(f32::MAX) {
            return Err(AttnError::ScoreOverflow { bound });
        }
        let heads = (0..shape.q.heads).map(|h| cfg.head_patterns(shape.q.heads, h)).collect();
        let packed = inputs.masks.packing.map(|p| p.cu_seqlens());
        let lanes = lanes(shape.q.batch, shape.q.seq, shape.kv.seq, packed);
        let plan = Plan {
            isa: self.isa,
            band: cfg.band(),
            scale,
            d,
            heads,
            group: shape.group_size(),
            q,
            k,
            v,
            padding: inputs.masks.key_padding,
            blocks: inputs.masks.block,
        };
        Ok((plan, lanes))
    }

    /// The forward behind [`Attention::forward`]: `out` (any row strides) and `lse`
    /// (natural log, `-inf` where a position is selected by none of its head's patterns).
    /// Keys with their own sequence length (cross-attention) sit at their own global
    /// indices `0..kv_seq`, under the same segments, patterns and causal mask.
    fn forward_impl<T: Element>(
        &self,
        inputs: &AttnInputs<'_, T>,
        mut out: TensorViewMut<'_, T>,
        lse: &mut [f32],
    ) -> Result<()> {
        // Outputs first: a broadcast (zero-stride) q may claim any shape, and `plan`
        // sizes and scans the inputs.
        let (cfg, s) = (inputs.cfg, inputs.q.shape());
        check_same(TensorName::Output, out.shape(), s)?;
        check_len(TensorName::Lse, lse.len(), s.lse_len())?;
        let (plan, lanes) = self.plan(inputs, Pass::Forward)?;
        let work = forward_units(&lanes, &forward_chunk_lens(cfg, lanes.len(), s.heads, longest(&lanes)));
        let out_geom = (out.shape(), out.strides());
        let out_rows = DisjointSlice::new(out.data_mut());
        let lse_rows = DisjointSlice::new(lse);
        self.pool.install(|| {
            work.par_iter().for_each_init(Scratch::default, |ws, u| {
                forward_unit(&plan, *u, ws);
                let n = u.c1 - u.c0;
                let out_scale = plan.heads[u.h].out_scale as f32;
                let Lane { b, base, .. } = u.lane;
                for t in 0..n {
                    let p = base + u.c0 + t;
                    let off = row_offset(out_geom, b, p, u.h);
                    // SAFETY: unit (lane, h, c0..c1) is the only writer of rows (b, p, h) for p
                    // in base + c0..c1 and of their LSE entries (lanes are disjoint row
                    // ranges); the view's strides keep rows disjoint.
                    let row = unsafe { out_rows.range_mut(off, plan.d) };
                    T::from_f32_scaled(row, &ws.acc_a[t * plan.d..(t + 1) * plan.d], out_scale);
                    // SAFETY: as above, one LSE entry per (b, p, h).
                    let l = unsafe { lse_rows.range_mut((b * s.seq + p) * s.heads + u.h, 1) };
                    l[0] = ws.acc_l[t];
                }
            })
        });
        Ok(())
    }

    /// The backward behind [`Attention::backward_with_lse_grad`]: `dq`, `dk`, `dv`
    /// (overwritten) of `sum(out * grad_out) + sum(lse * grad_lse)` from the forward's
    /// `out` and `lse`.
    fn backward_impl<T: Element>(
        &self,
        inputs: &AttnInputs<'_, T>,
        saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grad_lse: Option<&[f32]>,
        grads: AttnGrads<'_, T>,
    ) -> Result<()> {
        let (cfg, q, k) = (inputs.cfg, inputs.q, inputs.k);
        let (out, lse) = (saved.out, saved.lse);
        let AttnGrads { mut dq, mut dk, mut dv } = grads;
        // Shapes first, as in the forward (the gradients are the caller's own memory).
        let s = q.shape();
        check_same(TensorName::Output, out.shape(), s)?;
        check_same(TensorName::GradOutput, grad_out.shape(), s)?;
        check_len(TensorName::Lse, lse.len(), s.lse_len())?;
        if let Some(g) = grad_lse {
            check_len(TensorName::GradLse, g.len(), s.lse_len())?;
        }
        check_same(TensorName::GradQuery, dq.shape(), s)?;
        check_same(TensorName::GradKey, dk.shape(), k.shape())?;
        check_same(TensorName::GradValue, dv.shape(), k.shape())?;
        let (plan, lanes) = self.plan(inputs, Pass::Backward)?;
        if self.check_finite {
            check_finite(TensorName::GradOutput, &grad_out)?;
            // Rows that attend nothing take no gradient from the LSE, whatever it is.
            let bad = grad_lse.and_then(|g| g.iter().zip(lse).position(|(g, l)| l.is_finite() && !g.is_finite()));
            if let Some(index) = bad {
                return Err(AttnError::NonFinite { tensor: TensorName::GradLse, index });
            }
        }
        // The fused pass needs queries and keys at the same positions (self-attention shapes).
        let work: Vec<Task> = match fused_units(&plan, &lanes) {
            Some(f) => f.into_iter().map(Task::Fused).collect(),
            None => {
                let ch = chunk_len(cfg, lanes.len(), s.heads, longest(&lanes));
                let mut w: Vec<Task> =
                    split_units(&lanes, s.heads, ch, Side::Queries).into_iter().map(Task::Dq).collect();
                let kv_heads = k.shape().heads;
                w.extend(split_units(&lanes, kv_heads, ch, Side::Keys).into_iter().map(Task::Dkv));
                w
            }
        };
        let geoms = [(dq.shape(), dq.strides()), (dk.shape(), dk.strides()), (dv.shape(), dv.strides())];
        let (dq_rows, dk_rows, dv_rows) =
            (DisjointSlice::new(dq.data_mut()), DisjointSlice::new(dk.data_mut()), DisjointSlice::new(dv.data_mut()));
        let grads = Grads { out, lse, grad_out, grad_lse };
        self.pool.install(|| {
            work.par_iter().for_each_init(Scratch::default, |ws, task| {
                let (u, targets): (Unit, &[Target<'_, '_, T>]) = match *task {
                    Task::Dq(u) => {
                        dq_unit(&plan, &grads, u, ws);
                        (u, &[(0, &dq_rows, Acc::A)])
                    }
                    Task::Dkv(u) => {
                        dkv_unit(&plan, &grads, u, ws);
                        (u, &[(1, &dk_rows, Acc::A), (2, &dv_rows, Acc::B)])
                    }
                    Task::Fused(u) => {
                        fused_unit(&plan, &grads, u, ws);
                        (u, &[(0, &dq_rows, Acc::C), (1, &dk_rows, Acc::A), (2, &dv_rows, Acc::B)])
                    }
                };
                let n = u.c1 - u.c0;
                let Lane { b, base, .. } = u.lane;
                for &(which, rows, acc) in targets {
                    // Fused units hold dq of each query head of their key/value head's group.
                    let heads = if matches!((task, which), (Task::Fused(_), 0)) {
                        u.h * plan.group..(u.h + 1) * plan.group
                    } else {
                        u.h..u.h + 1
                    };
                    let acc = match acc {
                        Acc::A => &ws.acc_a,
                        Acc::B => &ws.acc_b,
                        Acc::C => &ws.acc_c,
                    };
                    for (i, h) in heads.enumerate() {
                        for t in 0..n {
                            let off = row_offset(geoms[which], b, base + u.c0 + t, h);
                            // SAFETY: this unit is the only writer of rows (b, base + c0..c1, h) of
                            // this gradient (dq units own query chunks of a query head, dkv units
                            // key chunks of a key/value head, fused units whole segments of a
                            // key/value head and its query heads; lanes are disjoint row ranges;
                            // each kind of work list partitions the rows).
                            let row = unsafe { rows.range_mut(off, plan.d) };
                            let src = &acc[(i * n + t) * plan.d..(i * n + t + 1) * plan.d];
                            for (o, a) in row.iter_mut().zip(src) {
                                *o = T::from_f32(*a);
                            }
                        }
                    }
                }
            })
        });
        Ok(())
    }

    /// Bytes of scratch memory a call on `shape` allocates (all workers together, an upper
    /// bound: for cross-attention, the bound of the longer of the two sequences), for
    /// memory budgets. Inputs and outputs are the caller's and not counted. Saturates at
    /// `usize::MAX`, which is also the answer for a shape no call accepts (`Shape4`'s
    /// fields are public: a zero or overflowing dimension), so a budget check refuses it.
    /// A call with packed sequences adds a little per sequence
    /// ([`CpuBackend::workspace_bytes_masked`]).
    pub fn workspace_bytes(&self, cfg: &DilatedConfig, shape: impl Into<AttnShape>, pass: Pass) -> usize {
        self.workspace_bytes_masked(cfg, shape.into(), &Masks::NONE, pass)
    }

    /// [`CpuBackend::workspace_bytes`] for a call with `masks` (packed sequences add
    /// their lanes' work units).
    pub fn workspace_bytes_masked(
        &self,
        cfg: &DilatedConfig,
        shape: AttnShape,
        masks: &Masks<'_>,
        pass: Pass,
    ) -> usize {
        let backward = pass == Pass::Backward;
        let (Ok(q), Ok(kv)) =
            (Shape4::named(TensorName::Query, shape.q.dims()), Shape4::named(TensorName::Key, shape.kv.dims()))
        else {
            return usize::MAX;
        };
        let group = (q.heads / kv.heads.max(1)).max(1);
        let shape = if kv.seq > q.seq { kv } else { q };
        let (d, dp) = (shape.head_dim, padded(shape.head_dim));
        // Rows of the longest unit (a fused unit of grouped heads spans their lcm, at most
        // FUSED_MAX_UNIT) and the most rows of one piece (O(patterns), never O(heads)).
        let fused = fused_unit_len(cfg, shape.heads, shape.seq)
            .map(|l| if group > 1 { FUSED_MAX_UNIT.min(shape.seq) } else { l });
        let unit = if backward {
            chunk_len(cfg, shape.batch, shape.heads, shape.seq).max(fused.unwrap_or(0))
        } else {
            max_forward_chunk_len(cfg, shape.batch, shape.heads, shape.seq)
        };
        let m = match cfg.window() {
            // A piece: a unit's rows and the window around them.
            Some(w) => unit.saturating_add(w.left).saturating_add(w.right).min(shape.seq),
            None => cfg
                .segment_lengths()
                .iter()
                .zip(cfg.dilation_rates())
                .map(|(&w, &r)| w.min(shape.seq).div_ceil(r))
                .max()
                .unwrap_or(0),
        };
        let (key_tile, q_chunk) =
            if backward { (KEY_TILE, QUERY_CHUNK) } else { (FORWARD_KEY_TILE, FORWARD_QUERY_CHUNK) };
        // The sizes below (each a few products of dimensions of a valid shape) fit in
        // u128; the total saturates to usize.
        let [d, dp, unit, m, key_tile, q_chunk, group] = [d, dp, unit, m, key_tile, q_chunk, group].map(|x| x as u128);
        let tiles = m.div_ceil(key_tile) * key_tile * dp;
        let chunk = q_chunk * dp;
        // Score-sized tiles: the backward's scores and dS (dq reads dS in place), three in
        // the forward.
        let small = if backward { 2 } else { 3 } * q_chunk * key_tile + 2 * q_chunk;
        let f32s = if backward {
            // 4 packed tile sets + dq accumulator, unit accumulators (dk, dv and the dq of
            // each query head of a group), 3 piece outputs.
            4 * tiles + m * dp + 4 * chunk + tiles / dp + (2 + group) * unit * d + unit + 3 * m * d + 2 * m + small
        } else {
            2 * tiles + 2 * chunk + unit * d + unit + m * d + m + small
        };
        // A block mask's split keeps a piece's rows and its runs besides (`block_split`).
        let usizes = if masks.block.is_some() { 10 * m } else { 6 * m };
        // The work list: at most two units per 64 rows of every (lane, head), plus one per
        // packed sequence and head.
        let sequences = masks.packing.map_or(0, |p| p.count()) as u128;
        let units = shape.batch as u128 * (shape.seq as u128 / 64 + 1) + sequences;
        let work = 2 * shape.heads as u128 * units * std::mem::size_of::<Task>() as u128;
        // The bf16 pair forward (AMX or AVX512-BF16) keeps its own packed bf16 tiles
        // beside the f32 scratch (a piece it hands back to the f32 kernel uses both).
        let pairs = crate::cpu::isa::ops::pair_scratch_bytes(self.isa, shape.head_dim, m as usize);
        let lanes = (shape.batch as u128 + sequences) * std::mem::size_of::<Lane>() as u128;
        let total = self.threads() as u128 * (4 * f32s + 8 * usizes + pairs) + work + lanes;
        usize::try_from(total).unwrap_or(usize::MAX)
    }

    /// Forward on contiguous buffers (q of `shape.q`, k and v of `shape.kv`: a [`Shape4`]
    /// is self-attention), returning `(out, lse)`.
    pub fn forward_vec<T: Element>(
        &self,
        cfg: &DilatedConfig,
        shape: impl Into<AttnShape>,
        q: &[T],
        k: &[T],
        v: &[T],
    ) -> Result<(Vec<T>, Vec<f32>)> {
        let shape = shape.into();
        let inputs = AttnInputs::contiguous(cfg, shape, [q, k, v])?;
        let mut out = zeroed_buffer(shape.q.numel())?;
        let mut lse = zeroed_buffer(shape.q.lse_len())?;
        self.forward_impl(&inputs, TensorViewMut::contiguous(TensorName::Output, &mut out, shape.q)?, &mut lse)?;
        Ok((out, lse))
    }

    /// Backward on contiguous buffers, returning `(dq, dk, dv)` (`dq` of `shape.q`, `dk`
    /// and `dv` of `shape.kv`).
    pub fn backward_vec<T: Element>(
        &self,
        cfg: &DilatedConfig,
        shape: impl Into<AttnShape>,
        [q, k, v]: [&[T]; 3],
        out: &[T],
        lse: &[f32],
        grad_out: &[T],
    ) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
        let shape = shape.into();
        let inputs = AttnInputs::contiguous(cfg, shape, [q, k, v])?;
        let saved = Saved { out: TensorView::contiguous(TensorName::Output, out, shape.q)?, lse };
        let gv = TensorView::contiguous(TensorName::GradOutput, grad_out, shape.q)?;
        let (mut dq, mut dk, mut dv) =
            (zeroed_buffer(shape.q.numel())?, zeroed_buffer(shape.kv.numel())?, zeroed_buffer(shape.kv.numel())?);
        self.backward_impl(&inputs, saved, gv, None, AttnGrads::contiguous(shape, [&mut dq, &mut dk, &mut dv])?)?;
        Ok((dq, dk, dv))
    }
}

/// The CPU kernels behind the shared interface. Keys and values with their own
/// sequence length are cross-attention (see `forward_impl`).
impl<T: Element> Attention<T> for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    fn forward(&self, inputs: &AttnInputs<'_, T>, out: TensorViewMut<'_, T>, lse: &mut [f32]) -> Result<()> {
        self.forward_impl(inputs, out, lse)
    }

    fn backward_with_lse_grad(
        &self,
        inputs: &AttnInputs<'_, T>,
        saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grad_lse: Option<&[f32]>,
        grads: AttnGrads<'_, T>,
    ) -> Result<()> {
        self.backward_impl(inputs, saved, grad_out, grad_lse, grads)
    }

    fn workspace_bytes(&self, cfg: &DilatedConfig, shape: AttnShape, pass: Pass) -> usize {
        CpuBackend::workspace_bytes(self, cfg, shape, pass)
    }

    fn workspace_bytes_masked(&self, cfg: &DilatedConfig, shape: AttnShape, masks: &Masks<'_>, pass: Pass) -> usize {
        CpuBackend::workspace_bytes_masked(self, cfg, shape, masks, pass)
    }
}

#[inline]
fn row_offset(geom: (Shape4, [usize; 4]), b: usize, s: usize, h: usize) -> usize {
    let st = geom.1;
    b * st[0] + s * st[1] + h * st[2]
}
