//! Parameter containers with PyTorch names: `MultiheadWeights` and the `NamedParams` walk used for I/O and checks.

use attn_core::{AttnError, Result};

use crate::config::{MultiheadConfig, NormLayout};
use crate::float::LayerFloat;
use crate::init::SeededRng;
use crate::layer_norm::LayerNorm;
use crate::projection::Linear;

/// One named parameter tensor (read-only).
#[derive(Debug)]
pub struct Param<'a, F> {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: &'a [F],
}

/// One named parameter tensor (mutable).
#[derive(Debug)]
pub struct ParamMut<'a, F> {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: &'a mut [F],
}

/// A module whose parameters have PyTorch `state_dict` names.
///
/// Both walks list the same names in the same order. A gradient container has the
/// same type as its module, so `grads.params()` lines up with `module.params()`.
pub trait NamedParams<F> {
    fn params_with_prefix<'a>(&'a self, prefix: &str, out: &mut Vec<Param<'a, F>>);
    fn params_mut_with_prefix<'a>(&'a mut self, prefix: &str, out: &mut Vec<ParamMut<'a, F>>);

    /// All parameters, in a fixed order.
    fn params(&self) -> Vec<Param<'_, F>> {
        let mut v = Vec::new();
        self.params_with_prefix("", &mut v);
        v
    }
    /// All parameters, mutable, in the same order as [`NamedParams::params`].
    fn params_mut(&mut self) -> Vec<ParamMut<'_, F>> {
        let mut v = Vec::new();
        self.params_mut_with_prefix("", &mut v);
        v
    }
    /// Total number of scalars.
    fn num_params(&self) -> usize {
        self.params().iter().map(|p| p.data.len()).sum()
    }
}

impl<F> NamedParams<F> for Linear<F> {
    fn params_with_prefix<'a>(&'a self, prefix: &str, out: &mut Vec<Param<'a, F>>) {
        out.push(Param { name: format!("{prefix}weight"), shape: vec![self.out_dim, self.in_dim], data: &self.weight });
        if let Some(b) = &self.bias {
            out.push(Param { name: format!("{prefix}bias"), shape: vec![self.out_dim], data: b });
        }
    }
    fn params_mut_with_prefix<'a>(&'a mut self, prefix: &str, out: &mut Vec<ParamMut<'a, F>>) {
        let shape = vec![self.out_dim, self.in_dim];
        out.push(ParamMut { name: format!("{prefix}weight"), shape, data: &mut self.weight });
        if let Some(b) = &mut self.bias {
            out.push(ParamMut { name: format!("{prefix}bias"), shape: vec![self.out_dim], data: b });
        }
    }
}

impl<F> NamedParams<F> for LayerNorm<F> {
    fn params_with_prefix<'a>(&'a self, prefix: &str, out: &mut Vec<Param<'a, F>>) {
        out.push(Param { name: format!("{prefix}weight"), shape: vec![self.dim], data: &self.weight });
        out.push(Param { name: format!("{prefix}bias"), shape: vec![self.dim], data: &self.bias });
    }
    fn params_mut_with_prefix<'a>(&'a mut self, prefix: &str, out: &mut Vec<ParamMut<'a, F>>) {
        out.push(ParamMut { name: format!("{prefix}weight"), shape: vec![self.dim], data: &mut self.weight });
        out.push(ParamMut { name: format!("{prefix}bias"), shape: vec![self.dim], data: &mut self.bias });
    }
}

/// Weights of one `MultiheadDilatedAttention`.
///
/// The q, k and v projections are stored stacked in `in_proj` (`[E + 2K, E]` with `K =
/// kv_dim`: rows `0..E` are `q_proj.weight`, then k's `K` rows, then v's; same for the
/// biases) so that self-attention projects with ONE GEMM into a `[batch, seq, heads +
/// 2 kv_heads, head_dim]` buffer. Names on disk stay PyTorch's: `q_proj.weight`,
/// `k_proj.bias`, ...
///
/// `norm` is the LayerNorm over the merged heads: sub-LN's `norm`, or under
/// [`NormLayout::QkLn`] `q_ln` (which also normalises q, so one tensor serves both and
/// its gradient sums both uses); `k_ln` exists only under `QkLn`.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiheadWeights<F> {
    pub embed_dim: usize,
    /// Rows of the k and v projections (`embed_dim` without grouped heads).
    pub kv_dim: usize,
    pub in_proj: Linear<F>,
    pub out_proj: Linear<F>,
    pub norm: Option<LayerNorm<F>>,
    /// `k_ln` over the projected k (`kv_dim` features; qk-LN only).
    pub k_ln: Option<LayerNorm<F>>,
    /// Where the LayerNorms sit; decides `norm`'s name (`norm.` or `q_ln.`).
    pub norm_layout: NormLayout,
}

const QKV: [&str; 3] = ["q_proj.", "k_proj.", "v_proj."];

impl<F: LayerFloat> MultiheadWeights<F> {
    /// MAGNETO init (SPEC.md): xavier-normal gain 1 for q and k, `gamma_init` for v and
    /// out, zero biases, LayerNorm weight 1 and bias 0.
    pub fn magneto(cfg: &MultiheadConfig, seed: u64) -> Self {
        let (e, kv) = (cfg.embed_dim, cfg.kv_dim());
        let mut rng = SeededRng::new(seed);
        let q = Linear::<F>::xavier(&mut rng, e, e, 1.0, cfg.bias.into());
        let k = Linear::<F>::xavier(&mut rng, e, kv, 1.0, cfg.bias.into());
        let v = Linear::<F>::xavier(&mut rng, e, kv, cfg.gamma_init, cfg.bias.into());
        let out_proj = Linear::xavier(&mut rng, e, e, cfg.gamma_init, cfg.bias.into());
        let weight = [q.weight, k.weight, v.weight].concat();
        let bias = cfg.bias.then(|| vec![F::zero(); e + 2 * kv]);
        MultiheadWeights {
            embed_dim: e,
            kv_dim: kv,
            in_proj: Linear { in_dim: e, out_dim: e + 2 * kv, weight, bias },
            out_proj,
            norm: cfg.layer_norm.then(|| LayerNorm::new(e, cfg.layer_norm_eps)),
            k_ln: cfg.qk_ln().then(|| LayerNorm::new(kv, cfg.layer_norm_eps)),
            norm_layout: cfg.norm_layout,
        }
    }

    /// All-zero weights of the same layout (a gradient accumulator).
    pub fn zeros_like(&self) -> Self {
        MultiheadWeights {
            embed_dim: self.embed_dim,
            kv_dim: self.kv_dim,
            in_proj: self.in_proj.zeros_like(),
            out_proj: self.out_proj.zeros_like(),
            norm: self.norm.as_ref().map(LayerNorm::zeros_like),
            k_ln: self.k_ln.as_ref().map(LayerNorm::zeros_like),
            norm_layout: self.norm_layout,
        }
    }
}

impl<F> MultiheadWeights<F> {
    /// The name prefix of `norm`: `norm.` (sub-LN) or `q_ln.` (qk-LN).
    fn norm_name(&self) -> &'static str {
        match self.norm_layout {
            NormLayout::SubLn => "norm.",
            NormLayout::QkLn => "q_ln.",
        }
    }

    /// Rows of the q, k and v parts of `in_proj`.
    pub fn part_rows(&self) -> [usize; 3] {
        [self.embed_dim, self.kv_dim, self.kv_dim]
    }

    /// Whether every buffer has the size `cfg` implies (the fields are public and the
    /// layer indexes by these sizes); otherwise a typed error naming `what`.
    pub(crate) fn check_layout(&self, cfg: &MultiheadConfig, what: &str) -> Result<()> {
        let e = cfg.embed_dim;
        let linear_ok = |l: &Linear<F>, out: usize| {
            l.in_dim == e
                && l.out_dim == out
                && Some(l.weight.len()) == out.checked_mul(e)
                && l.bias.as_ref().map(Vec::len) == cfg.bias.then_some(out)
        };
        let kv = cfg.kv_dim();
        let ln_ok = |n: &Option<LayerNorm<F>>, present: bool, dim: usize| match n {
            None => !present,
            Some(n) => present && n.dim == dim && n.weight.len() == dim && n.bias.len() == dim,
        };
        let norm_ok = ln_ok(&self.norm, cfg.layer_norm, e)
            && ln_ok(&self.k_ln, cfg.qk_ln(), kv)
            && (!cfg.layer_norm || self.norm_layout == cfg.norm_layout);
        if self.embed_dim != e
            || self.kv_dim != kv
            || !linear_ok(&self.in_proj, e.saturating_add(kv.saturating_mul(2)))
            || !linear_ok(&self.out_proj, e)
            || !norm_ok
        {
            return Err(AttnError::InvalidArgument(format!(
                "{what} do not match the config (embed_dim {e}, kv_dim {kv}, bias {}, layer_norm {}, norm_layout {:?})",
                cfg.bias, cfg.layer_norm, cfg.norm_layout
            )));
        }
        Ok(())
    }
}

/// Split `data` into consecutive parts of `sizes` elements; a part `data` has run out
/// for is `None`, one it covers only in part is shorter (the fields are public, so a
/// walk never panics on a bad buffer).
fn split_parts<T>(data: &[T], sizes: [usize; 3]) -> Vec<Option<&[T]>> {
    let mut rest = data;
    sizes
        .iter()
        .map(|&n| {
            let (a, b) = rest.split_at(n.min(rest.len()));
            rest = b;
            (!a.is_empty() || n == 0).then_some(a)
        })
        .collect()
}

/// [`split_parts`] for a mutable buffer.
fn split_parts_mut<T>(data: &mut [T], sizes: [usize; 3]) -> Vec<Option<&mut [T]>> {
    let mut rest = data;
    sizes
        .iter()
        .map(|&n| {
            let k = n.min(rest.len());
            let (a, b) = std::mem::take(&mut rest).split_at_mut(k);
            rest = b;
            (!a.is_empty() || n == 0).then_some(a)
        })
        .collect()
}

impl<F> NamedParams<F> for MultiheadWeights<F> {
    fn params_with_prefix<'a>(&'a self, prefix: &str, out: &mut Vec<Param<'a, F>>) {
        let (e, rows) = (self.embed_dim, self.part_rows());
        let weights = split_parts(&self.in_proj.weight, rows.map(|r| r.saturating_mul(e)));
        let biases = self.in_proj.bias.as_deref().map(|b| split_parts(b, rows));
        for (i, part) in weights.into_iter().enumerate() {
            let Some(part) = part else { continue };
            out.push(Param { name: format!("{prefix}{}weight", QKV[i]), shape: vec![rows[i], e], data: part });
            if let Some(b) = biases.as_ref().and_then(|b| b[i]) {
                out.push(Param { name: format!("{prefix}{}bias", QKV[i]), shape: vec![rows[i]], data: b });
            }
        }
        if let Some(n) = &self.norm {
            n.params_with_prefix(&format!("{prefix}{}", self.norm_name()), out);
        }
        if let Some(n) = &self.k_ln {
            n.params_with_prefix(&format!("{prefix}k_ln."), out);
        }
        self.out_proj.params_with_prefix(&format!("{prefix}out_proj."), out);
    }
    fn params_mut_with_prefix<'a>(&'a mut self, prefix: &str, out: &mut Vec<ParamMut<'a, F>>) {
        let (e, rows, norm_name) = (self.embed_dim, self.part_rows(), self.norm_name());
        let weights = split_parts_mut(&mut self.in_proj.weight, rows.map(|r| r.saturating_mul(e)));
        let mut biases: Vec<Option<&'a mut [F]>> = match &mut self.in_proj.bias {
            Some(b) => split_parts_mut(b, rows),
            None => vec![None, None, None],
        };
        for (i, part) in weights.into_iter().enumerate() {
            let Some(part) = part else { continue };
            out.push(ParamMut { name: format!("{prefix}{}weight", QKV[i]), shape: vec![rows[i], e], data: part });
            if let Some(b) = biases.get_mut(i).and_then(Option::take) {
                out.push(ParamMut { name: format!("{prefix}{}bias", QKV[i]), shape: vec![rows[i]], data: b });
            }
        }
        if let Some(n) = &mut self.norm {
            n.params_mut_with_prefix(&format!("{prefix}{norm_name}"), out);
        }
        if let Some(n) = &mut self.k_ln {
            n.params_mut_with_prefix(&format!("{prefix}k_ln."), out);
        }
        self.out_proj.params_mut_with_prefix(&format!("{prefix}out_proj."), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn std_of(v: &[f64]) -> f64 {
        (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt()
    }

    #[test]
    fn magneto_init_scales_v_and_out_by_gamma() {
        let cfg = MultiheadConfig::new(256, 4, attn_core::DilatedConfig::new(&[8], &[1]).unwrap()).with_gamma_init(3.0);
        let w = MultiheadWeights::<f64>::magneto(&cfg, 5);
        let xavier = (2.0f64 / 512.0).sqrt();
        let p = w.params();
        let by = |n: &str| p.iter().find(|x| x.name == n).unwrap().data;
        for (name, gain) in
            [("q_proj.weight", 1.0), ("k_proj.weight", 1.0), ("v_proj.weight", 3.0), ("out_proj.weight", 3.0)]
        {
            let s = std_of(by(name));
            assert!((s / (gain * xavier) - 1.0).abs() < 0.02, "{name}: std {s}");
        }
        for name in ["q_proj.bias", "v_proj.bias", "out_proj.bias", "norm.bias"] {
            assert!(by(name).iter().all(|&x| x == 0.0), "{name} starts at zero");
        }
        assert!(by("norm.weight").iter().all(|&x| x == 1.0));
        assert_eq!(w, MultiheadWeights::<f64>::magneto(&cfg, 5), "seeded");
    }
}
