//! The runner of the attention-feature cases on `CpuBackend`, through the `Attention`
//! interface: grouped key/value heads (and the same problem with K/V repeated to every
//! query head by the caller in each call, as `repeat_interleave` before a multi-head
//! kernel does), packed variable-length sequences (`cu_seqlens`), the same sequences
//! padded to the longest with a key padding mask, sliding windows and block masks. Output, LSE and
//! gradient buffers are allocated on every call, as `--impl cpu` does.

use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnError, AttnInputs, AttnShape, BlockMaskBuf, DType, DilatedConfig, Element, Grads, KeyPadding, Masks,
    PackedSequences, Pass, Result, Saved, Shape4, TensorView, TensorViewMut,
};
use attn_kernels::{CpuBackend, zeroed_buffer};
use half::{bf16, f16};

use crate::case::{CaseSpec, VarLenLayout};
use crate::inputs::normal_vec;
use crate::runner::{RunStats, Runner};

/// Build the feature runner for `spec` in its dtype.
pub fn features(spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    match spec.dtype {
        DType::F32 => Ok(Box::new(FeatureRunner::<f32>::new(spec)?)),
        DType::BF16 => Ok(Box::new(FeatureRunner::<bf16>::new(spec)?)),
        DType::F16 => Ok(Box::new(FeatureRunner::<f16>::new(spec)?)),
        other => {
            Err(AttnError::InvalidArgument(format!("dtype {} is not benchmarked on the cpu backend", other.as_str())))
        }
    }
}

/// `x` (`[batch, seq, kv_heads, head_dim]`, row-major) with every head repeated `group`
/// times in place (`[batch, seq, kv_heads * group, head_dim]`): query head `h` reads
/// key/value head `h / group`, PyTorch's `repeat_interleave(group, dim=2)`.
pub fn repeat_heads<T: Element>(x: &[T], kv: Shape4, group: usize) -> Result<Vec<T>> {
    let d = kv.head_dim;
    let mut out = zeroed_buffer(x.len() * group)?;
    for (src, dst) in x.chunks_exact(d).zip(out.chunks_exact_mut(d * group)) {
        for slot in dst.chunks_exact_mut(d) {
            slot.copy_from_slice(src);
        }
    }
    Ok(out)
}

/// The library's figure for one call of `spec`: q, k, v, out and LSE at the sizes the
/// caller holds them, the repeated K/V (when the caller repeats), the gradients and
/// grad_out (forward+backward), the masks, and `CpuBackend::workspace_bytes_masked`.
pub fn workspace_query(spec: &CaseSpec) -> Option<u64> {
    let (cfg, shape, e) = (spec.config().ok()?, spec.attn_shape().ok()?, spec.dtype.size());
    let kernel = if spec.repeat_kv { AttnShape::self_attn(shape.q) } else { shape };
    let (nq, nk) = (shape.q.numel(), shape.kv.numel());
    let mut bytes = (2 * nq + 2 * nk) * e + shape.q.lse_len() * 4;
    if spec.repeat_kv {
        bytes += 2 * kernel.kv.numel() * e;
    }
    if spec.backward {
        bytes += (2 * nq + 2 * kernel.kv.numel()) * e;
    }
    let (flags, cu) = match &spec.varlen {
        Some(v) if v.layout == VarLenLayout::Packed => (Vec::new(), v.cu_seqlens()),
        Some(v) => (v.padding_flags(), Vec::new()),
        None => (Vec::new(), Vec::new()),
    };
    bytes += flags.len() + cu.len() * std::mem::size_of::<usize>();
    let block = spec.block_sparse.map(|b| crate::block_sparse::mask(&b, shape.q.seq)).transpose().ok()?;
    bytes += block.as_ref().map_or(0, |m| m.view().keep().len());
    let masks = Masks {
        key_padding: (!flags.is_empty())
            .then(|| KeyPadding::new(&flags, shape.kv.batch, shape.kv.seq))
            .transpose()
            .ok()?,
        packing: (!cu.is_empty()).then(|| PackedSequences::new(&cu)).transpose().ok()?,
        block: block.as_ref().map(|m| m.view()),
    };
    let pass = if spec.backward { Pass::Backward } else { Pass::Forward };
    let backend = CpuBackend::new(spec.threads).ok()?;
    Some((bytes + backend.workspace_bytes_masked(&cfg, kernel, &masks, pass)) as u64)
}

struct FeatureRunner<T> {
    backend: CpuBackend,
    cfg: DilatedConfig,
    /// The shapes the caller holds: k and v with their own head count.
    shape: AttnShape,
    /// Query heads per key/value head to repeat K/V to in every call (1: none).
    repeat: usize,
    backward: bool,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    grad_out: Vec<T>,
    /// The padded layout's key padding flags (`[batch, seq]`).
    padding: Option<Vec<bool>>,
    /// The packed layout's sequence offsets.
    cu_seqlens: Option<Vec<usize>>,
    /// The block-sparse rows' mask.
    block: Option<BlockMaskBuf>,
}

/// What one call produced: the output, its LSE and (forward+backward) dq, dk, dv.
struct Outputs<T> {
    out: Vec<T>,
    lse: Vec<f32>,
    grads: Option<[Vec<T>; 3]>,
}

impl<T: Element> FeatureRunner<T> {
    fn new(spec: &CaseSpec) -> Result<Self> {
        let shape = spec.attn_shape()?;
        let repeat = if spec.repeat_kv { shape.group_size() } else { 1 };
        if repeat > 1 && spec.backward {
            return Err(AttnError::InvalidArgument(
                "the repeated-K/V baseline is forward only (its dk and dv would need summing back per group)".into(),
            ));
        }
        let (padding, cu_seqlens) = match &spec.varlen {
            Some(v) if v.layout == VarLenLayout::Packed => (None, Some(v.cu_seqlens())),
            Some(v) => (Some(v.padding_flags()), None),
            None => (None, None),
        };
        let (nq, nk) = (shape.q.numel(), shape.kv.numel());
        Ok(FeatureRunner {
            backend: CpuBackend::new(spec.threads)?,
            cfg: spec.config()?,
            shape,
            repeat,
            backward: spec.backward,
            q: normal_vec(1, nq),
            k: normal_vec(2, nk),
            v: normal_vec(3, nk),
            grad_out: if spec.backward { normal_vec(4, nq) } else { Vec::new() },
            padding,
            cu_seqlens,
            block: spec.block_sparse.map(|b| crate::block_sparse::mask(&b, shape.q.seq)).transpose()?,
        })
    }

    fn call(&self) -> Result<Outputs<T>> {
        let (q, kv) = (self.shape.q, self.shape.kv);
        // The caller's repeat: fresh K/V buffers of every query head, on every call.
        let repeated = if self.repeat > 1 {
            Some((repeat_heads(&self.k, kv, self.repeat)?, repeat_heads(&self.v, kv, self.repeat)?))
        } else {
            None
        };
        let (shape, k, v) = match &repeated {
            Some((k, v)) => (AttnShape::self_attn(q), &k[..], &v[..]),
            None => (self.shape, &self.k[..], &self.v[..]),
        };
        let masks = Masks {
            key_padding: self.padding.as_deref().map(|f| KeyPadding::new(f, kv.batch, kv.seq)).transpose()?,
            packing: self.cu_seqlens.as_deref().map(PackedSequences::new).transpose()?,
            block: self.block.as_ref().map(|m| m.view()),
        };
        let inputs = AttnInputs::contiguous(&self.cfg, shape, [&self.q, k, v])?.with_masks(masks);
        let mut out = zeroed_buffer(q.numel())?;
        let mut lse = zeroed_buffer(q.lse_len())?;
        Attention::<T>::forward(
            &self.backend,
            &inputs,
            TensorViewMut::contiguous(TensorName::Output, &mut out, q)?,
            &mut lse,
        )?;
        let grads = if self.backward {
            let (mut dq, mut dk, mut dv) =
                (zeroed_buffer(q.numel())?, zeroed_buffer(shape.kv.numel())?, zeroed_buffer(shape.kv.numel())?);
            let saved = Saved { out: TensorView::contiguous(TensorName::Output, &out, q)?, lse: &lse };
            let go = TensorView::contiguous(TensorName::GradOutput, &self.grad_out, q)?;
            let views = Grads::contiguous(shape, [&mut dq, &mut dk, &mut dv])?;
            Attention::<T>::backward(&self.backend, &inputs, saved, go, views)?;
            Some([dq, dk, dv])
        } else {
            None
        };
        Ok(Outputs { out, lse, grads })
    }
}

impl<T: Element> Runner for FeatureRunner<T> {
    fn run(&mut self) -> Result<RunStats> {
        let Outputs { out, lse, grads } = self.call()?;
        std::hint::black_box((out, lse, grads));
        Ok(RunStats::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::Implementation;
    use crate::case::VarLenLayout;
    use attn_core::Causality;

    #[test]
    fn heads_repeat_in_place_as_repeat_interleave_does() {
        // [1, 2, 2, 3]: rows (s, kv head) hold 3 values each.
        let kv = Shape4::new(1, 2, 2, 3).unwrap();
        let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let y = repeat_heads(&x, kv, 2).unwrap();
        let want = [0., 1., 2., 0., 1., 2., 3., 4., 5., 3., 4., 5., 6., 7., 8., 6., 7., 8., 9., 10., 11., 9., 10., 11.];
        assert_eq!(y, want);
        assert_eq!(repeat_heads(&x, kv, 1).unwrap(), x);
    }

    fn small(kv_heads: usize, repeat_kv: bool) -> CaseSpec {
        let mut s = CaseSpec::dilated(Implementation::Cpu, 96, &[32, 64], &[1, 2]);
        (s.kv_heads, s.repeat_kv, s.heads, s.head_dim, s.threads) = (Some(kv_heads), repeat_kv, 4, 16, 1);
        s
    }

    /// Grouped heads give what the caller's repeated K/V give, bit for bit (the same
    /// kernel reads the same values), and the repeat refuses a backward.
    #[test]
    fn grouped_heads_equal_repeated_kv() {
        let gqa = FeatureRunner::<f32>::new(&small(1, false)).unwrap().call().unwrap();
        let rep = FeatureRunner::<f32>::new(&small(1, true)).unwrap().call().unwrap();
        assert_eq!(gqa.out, rep.out);
        assert_eq!(gqa.lse, rep.lse);
        assert!(FeatureRunner::<f32>::new(&CaseSpec { backward: true, ..small(1, true) }).is_err());
        let bwd = FeatureRunner::<f32>::new(&CaseSpec { backward: true, ..small(2, false) }).unwrap().call().unwrap();
        let [dq, dk, dv] = bwd.grads.unwrap();
        assert_eq!((dq.len(), dk.len(), dv.len()), (96 * 4 * 16, 96 * 2 * 16, 96 * 2 * 16));
    }

    /// Packed and padded layouts of the same sequences give the same outputs (and
    /// gradients) at every real position; non-causal, the mask hides padded keys that
    /// share a segment with real queries.
    #[test]
    fn packed_and_padded_agree_on_real_tokens() {
        let lengths = [5, 40, 17];
        for (causal, backward) in [(true, false), (false, false), (true, true), (false, true)] {
            let mut base =
                CaseSpec { causal, backward, ..CaseSpec::dilated(Implementation::Cpu, 1, &[16, 32], &[1, 2]) };
            (base.heads, base.head_dim, base.threads) = (2, 8, 1);
            let run = |layout| {
                let spec = CaseSpec::varlen(&base, (1, 40), &lengths, layout);
                let mut r = FeatureRunner::<f32>::new(&spec).unwrap();
                // The same values per sequence in both layouts: packed row i of the batch is
                // padded row (b, p); padding rows get values the mask must hide.
                let row = base.heads * base.head_dim;
                let packed = normal_vec::<f32>(1, lengths.iter().sum::<usize>() * row);
                let go = normal_vec::<f32>(4, packed.len());
                let place = |src: &[f32], pad: f32| -> Vec<f32> {
                    match layout {
                        VarLenLayout::Packed => src.to_vec(),
                        VarLenLayout::Padded => {
                            let mut y = vec![pad; 3 * 40 * row];
                            let mut at = 0;
                            for (b, &n) in lengths.iter().enumerate() {
                                y[b * 40 * row..(b * 40 + n) * row].copy_from_slice(&src[at..at + n * row]);
                                at += n * row;
                            }
                            y
                        }
                    }
                };
                (r.q, r.k, r.v) = (place(&packed, 0.3), place(&packed, 5.0), place(&packed, -7.0));
                r.grad_out = if backward { place(&go, 0.0) } else { Vec::new() };
                let o = r.call().unwrap();
                let real = |x: &[f32]| -> Vec<f32> {
                    match layout {
                        VarLenLayout::Packed => x.to_vec(),
                        VarLenLayout::Padded => lengths
                            .iter()
                            .enumerate()
                            .flat_map(|(b, &n)| x[b * 40 * row..(b * 40 + n) * row].to_vec())
                            .collect(),
                    }
                };
                let grads = o.grads.map(|g| g.map(|x| real(&x)));
                (real(&o.out), grads)
            };
            let (a, ga) = run(VarLenLayout::Packed);
            let (b, gb) = run(VarLenLayout::Padded);
            let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + a.abs()));
            assert!(a.len() == b.len() && close(&a, &b), "causal={causal}: outputs differ");
            if let (Some(ga), Some(gb)) = (ga, gb) {
                for (x, y) in ga.iter().zip(&gb) {
                    assert!(close(x, y), "causal={causal}: gradients differ");
                }
            }
        }
    }

    #[test]
    fn windows_run_and_refuse_what_they_cannot() {
        let mut w = CaseSpec::window(Implementation::Cpu, 300, (31, 0), Causality::Causal);
        (w.heads, w.head_dim, w.threads) = (2, 8, 1);
        let o = FeatureRunner::<f32>::new(&w).unwrap().call().unwrap();
        assert!(o.out.iter().all(|x| x.is_finite()) && o.lse.len() == 300 * 2);
        assert!(features(&CaseSpec { dtype: DType::F64, ..w }).is_err());
    }
}
