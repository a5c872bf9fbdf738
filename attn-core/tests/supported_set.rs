//! A backend's [`Supported`] set is a checked promise: a backend declaring less than
//! every feature refuses each call using a feature outside its set with
//! `AttnError::Unsupported` naming itself and that feature, and computes the rest exactly
//! as the backend it wraps.

use attn_core::{
    Attention, AttnError, AttnInputs, AttnShape, BlockDims, BlockMaskBuf, DilatedConfig, Feature, Grads, KeyPadding,
    Masks, PackedSequences, Pass, ReferenceBackend, Result, Saved, Shape4, Supported, TensorView, TensorViewMut,
};

/// The reference behind a declared feature set.
#[derive(Debug)]
struct Declaring {
    name: &'static str,
    supported: Supported,
}

impl Attention<f64> for Declaring {
    fn name(&self) -> &str {
        self.name
    }
    fn forward(&self, inputs: &AttnInputs<'_, f64>, out: TensorViewMut<'_, f64>, lse: &mut [f32]) -> Result<()> {
        inputs.shape_for(self.name, self.supported)?;
        ReferenceBackend.forward(inputs, out, lse)
    }
    fn backward_with_lse_grad(
        &self,
        inputs: &AttnInputs<'_, f64>,
        saved: Saved<'_, f64>,
        grad_out: TensorView<'_, f64>,
        grad_lse: Option<&[f32]>,
        grads: Grads<'_, f64>,
    ) -> Result<()> {
        inputs.shape_for(self.name, self.supported)?;
        ReferenceBackend.backward_with_lse_grad(inputs, saved, grad_out, grad_lse, grads)
    }
    fn workspace_bytes(&self, cfg: &DilatedConfig, shape: AttnShape, pass: Pass) -> usize {
        Attention::<f64>::workspace_bytes(&ReferenceBackend, cfg, shape, pass)
    }
}

/// One call of each checked feature, alone: its config, shapes and masks.
struct FeatureCall {
    feature: Feature,
    cfg: DilatedConfig,
    shape: AttnShape,
    padding: bool,
    packing: bool,
    block: bool,
}

fn calls() -> Vec<FeatureCall> {
    let dilated = DilatedConfig::new(&[4, 8], &[1, 2]).unwrap();
    let q = Shape4::new(1, 8, 2, 4).unwrap();
    let call = |feature, cfg: &DilatedConfig, shape, padding, packing| FeatureCall {
        feature,
        cfg: cfg.clone(),
        shape,
        padding,
        block: feature == Feature::BlockMask,
        packing,
    };
    vec![
        call(Feature::GroupedKv, &dilated, AttnShape { q, kv: Shape4 { heads: 1, ..q } }, false, false),
        call(Feature::KeyPadding, &dilated, AttnShape::self_attn(q), true, false),
        call(Feature::Packing, &dilated, AttnShape::self_attn(q), false, true),
        call(Feature::Window, &DilatedConfig::sliding_window(2, 1).unwrap(), AttnShape::self_attn(q), false, false),
        call(Feature::CrossAttention, &dilated, AttnShape { q, kv: Shape4 { seq: 12, ..q } }, false, false),
        call(Feature::BlockMask, &dilated, AttnShape::self_attn(q), false, false),
    ]
}

/// The forward of `backend` on the call (inputs from a fixed formula).
fn forward(backend: &dyn Attention<f64>, c: &FeatureCall) -> Result<(Vec<f64>, Vec<f32>)> {
    let (nq, nk) = (c.shape.q.numel(), c.shape.kv.numel());
    let x: Vec<f64> = (0..nq.max(nk)).map(|i| (i as f64 * 0.37).sin()).collect();
    let flags: Vec<bool> = (0..c.shape.kv.batch * c.shape.kv.seq).map(|i| i % 3 == 1).collect();
    let cu = [0, 3, c.shape.q.seq];
    // Blocks of 3 over the 8 positions: the diagonal and the first key block kept.
    let blocks = BlockDims { batch: 1, heads: 1, q_blocks: 3, k_blocks: 3 };
    let block = BlockMaskBuf::from_fn(blocks, 3, |_, _, i, j| j == i || j == 0).unwrap();
    let masks = Masks {
        key_padding: c.padding.then(|| KeyPadding::new(&flags, c.shape.kv.batch, c.shape.kv.seq).unwrap()),
        packing: c.packing.then(|| PackedSequences::new(&cu).unwrap()),
        block: c.block.then(|| block.view()),
    };
    let inputs = AttnInputs::contiguous(&c.cfg, c.shape, [&x[..nq], &x[..nk], &x[..nk]])?.with_masks(masks);
    let mut out = vec![0.0; nq];
    let mut lse = vec![0.0; c.shape.q.lse_len()];
    backend.forward(
        &inputs,
        TensorViewMut::contiguous(attn_core::TensorName::Output, &mut out, c.shape.q)?,
        &mut lse,
    )?;
    Ok((out, lse))
}

#[test]
fn a_backend_declaring_less_refuses_each_feature_outside_its_set() {
    let calls = calls();
    assert_eq!(calls.len(), Feature::CHECKED.len());
    for declared in &calls {
        let name = "declares one feature";
        let one = Declaring { name, supported: Supported::of(&[declared.feature]) };
        for c in &calls {
            let got = forward(&one, c);
            if c.feature == declared.feature {
                assert_eq!(got.unwrap(), forward(&ReferenceBackend, c).unwrap(), "{}", c.feature);
            } else {
                match got {
                    Err(AttnError::Unsupported { backend, feature }) => {
                        assert_eq!((backend, feature), (name, c.feature));
                    }
                    other => panic!("{name} accepted {}: {:?}", c.feature, other.err()),
                }
            }
        }
    }
    let err = forward(&Declaring { name: "dense", supported: Supported::NONE }, &calls[3]).unwrap_err();
    assert_eq!(err.to_string(), "dense does not support sliding windows");
}

#[test]
fn supported_is_a_set() {
    assert!(Feature::CHECKED.iter().all(|&f| Supported::ALL.contains(f) && !Supported::NONE.contains(f)));
    assert!(!Supported::ALL.contains(Feature::Other("a device")));
    let no_window = Supported::ALL.without(Feature::Window);
    assert!(!no_window.contains(Feature::Window) && no_window.contains(Feature::Packing));
    assert_eq!(Supported::of(&Feature::CHECKED), Supported::ALL);
    assert_eq!(format!("{:?}", Supported::of(&[Feature::Window])), "{Window}");
    let used = [Feature::GroupedKv, Feature::Window];
    assert!(matches!(
        no_window.check("b", used),
        Err(AttnError::Unsupported { backend: "b", feature: Feature::Window })
    ));
    assert!(Supported::ALL.check("b", used).is_ok());
}
