//! Pieces: the rows of one pattern segment (selected queries, selected keys), found from
//! global positions, and handed to the tile kernels.

use attn_core::{Element, LseMerge, SegmentPattern};

use crate::isa::Isa;

/// Rows addressed by element offsets into `data`, with global positions.
#[derive(Debug, Clone, Copy)]
pub struct PieceRows<'a, T> {
    pub data: &'a [T],
    pub offsets: &'a [usize],
    pub pos: &'a [usize],
}

impl<T: Element> PieceRows<'_, T> {
    #[inline]
    pub fn row(&self, i: usize, d: usize) -> &[T] {
        &self.data[self.offsets[i]..self.offsets[i] + d]
    }
}

/// Gradient buffers of one block call (see `attend_block_backward`).
#[derive(Debug)]
pub struct BlockGrads<'a> {
    pub grad_out_eff: &'a [f32],
    pub lse: &'a [f32],
    pub delta: &'a [f32],
    pub dq: &'a mut [f32],
    pub dk: &'a mut [f32],
    pub dv: &'a mut [f32],
}

fn dot<T: Element>(a: &[T], b: &[T]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x.to_f32() * y.to_f32()).sum()
}

/// Forward of a block (simple version): per query an online softmax over admitted keys.
#[allow(clippy::too_many_arguments)]
pub fn forward_block<T: Element>(
    _isa: Isa,
    pattern: &SegmentPattern,
    causal: bool,
    scale: f32,
    d: usize,
    q: &PieceRows<'_, T>,
    k: &PieceRows<'_, T>,
    v: &PieceRows<'_, T>,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let mut o = vec![0.0f32; d];
    let mut vrow = vec![0.0f32; d];
    for i in 0..q.pos.len() {
        let mut sm = attn_core::OnlineSoftmax::<f32>::new(d);
        let qi = q.row(i, d);
        for j in 0..k.pos.len() {
            if pattern.attends(q.pos[i], k.pos[j], causal) {
                let s = scale * dot(qi, k.row(j, d));
                vrow.iter_mut().zip(v.row(j, d)).for_each(|(a, b)| *a = b.to_f32());
                sm.push(s, &vrow);
            }
        }
        let l = sm.finish(&mut o);
        LseMerge::merge_into(&mut out[i * d..(i + 1) * d], &mut lse[i], &o, l);
    }
}

/// Backward of a block (simple version).
#[allow(clippy::too_many_arguments)]
pub fn backward_block<T: Element>(
    _isa: Isa,
    pattern: &SegmentPattern,
    causal: bool,
    scale: f32,
    d: usize,
    q: &PieceRows<'_, T>,
    k: &PieceRows<'_, T>,
    v: &PieceRows<'_, T>,
    g: BlockGrads<'_>,
) {
    for i in 0..q.pos.len() {
        if g.lse[i] == f32::NEG_INFINITY {
            continue;
        }
        let qi = q.row(i, d);
        let go = &g.grad_out_eff[i * d..(i + 1) * d];
        for j in 0..k.pos.len() {
            if !pattern.attends(q.pos[i], k.pos[j], causal) {
                continue;
            }
            let (kj, vj) = (k.row(j, d), v.row(j, d));
            let p = (scale * dot(qi, kj) - g.lse[i]).exp();
            let dp: f32 = go.iter().zip(vj).map(|(a, b)| a * b.to_f32()).sum();
            let ds = p * (dp - g.delta[i]) * scale;
            for e in 0..d {
                g.dv[j * d + e] += p * go[e];
                g.dq[i * d + e] += ds * kj[e].to_f32();
                g.dk[j * d + e] += ds * qi[e].to_f32();
            }
        }
    }
}
