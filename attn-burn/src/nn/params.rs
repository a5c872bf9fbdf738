//! [`ParamSource`]: parameter values by PyTorch name, taken from any of
//! `attn-multihead`'s parameter containers ([`NamedParams`]), and the burn parameters
//! made of them on a device in a dtype.

use std::collections::BTreeMap;

use attn_core::{AttnError, Result, TensorName};
use attn_multihead::{LayerFloat, NamedParams};
use burn::module::Param;
use burn_tensor::{DType, Device, Tensor, TensorData};

/// Named parameter values (f32, row-major, PyTorch shapes) and where their burn
/// parameters go.
#[derive(Debug, Clone)]
pub struct ParamSource {
    values: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    device: Device,
    dtype: DType,
}

impl ParamSource {
    /// The parameters of `module` (as `attn-multihead` names them), for burn parameters on
    /// `device` in `dtype`.
    pub fn of<F: LayerFloat>(module: &impl NamedParams<F>, device: &Device, dtype: DType) -> Self {
        let values = module
            .params()
            .into_iter()
            .map(|p| (p.name, (p.shape, p.data.iter().map(|&x| <F as attn_core::Element>::to_f32(x)).collect())))
            .collect();
        ParamSource { values, device: device.clone(), dtype }
    }

    /// Whether a parameter `name` is present.
    pub fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    /// The parameter `name`, of rank `D`, as a trainable burn parameter.
    pub(crate) fn param<const D: usize>(&self, name: &str) -> Result<Param<Tensor<D>>> {
        let (shape, data) =
            self.values.get(name).ok_or_else(|| AttnError::Format(format!("missing parameter `{name}`")))?;
        let dims: [usize; D] = shape.as_slice().try_into().map_err(|_| AttnError::RankMismatch {
            tensor: TensorName::Other("parameter"),
            expected: D,
            got: shape.len(),
        })?;
        let t = Tensor::<D>::from_data(TensorData::new(data.clone(), dims), (&self.device, self.dtype));
        Ok(Param::from_tensor(t))
    }
}
