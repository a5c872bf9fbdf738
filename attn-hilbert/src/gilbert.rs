//! Generalised Hilbert ("gilbert") curves for rectangles and boxes of any size.
//!
//! This is the Gilbert++ construction of the gilbert project (Jakub Červený and
//! contributors, <https://github.com/jakubcerveny/gilbert>, extensions released CC0),
//! written here from its description: a box spanned by the signed axis vectors
//! `alpha`, `beta`, `gamma` from corner `p` is cut into 2 (eccentric boxes), 3
//! (one axis much longer) or 5 (bulk) sub-boxes whose curves join end to start,
//! with halves rounded to even (or odd) lengths so that every sub-curve can end
//! next to where the next one starts. Lines and 2x2x2 cubes are the leaves.
//! [`hilbert_indices`] picks the leading axis so that parity never forces a
//! diagonal step, and [`Walk::aligned_2d`]/[`Walk::aligned_3d`] keep cuts on
//! power-of-two tile boundaries (see the crate docs). In 2D, a sub-rectangle
//! whose sides share a power-of-two factor `u >= 2` (and are at least two tiles
//! long) switches to those aligned cuts, and cuts inside other rectangles go at a
//! multiple of the largest power of two within 40%..60% of the side
//! ([`half_aligned`]) rather than at the exact middle: more pieces then tile
//! into aligned squares. On the 900-grid sweep of `examples/locality_sweep.rs`
//! this raised the mean neighbour-in-segment fraction from 0.903 to 0.908
//! (segments 64/256) and from 0.931 to 0.936 (segments 96/200/1000); in 3D the
//! same cuts did not help and are not used.
//!
//! The walk is recursive with depth `O(log n)` and emits each cell once: `O(n)`.
//! It counts its own work ([`Walk::steps`]: every recursive call and every loop
//! iteration of [`half_aligned`]) so tests can check the linear bound by counting
//! rather than timing (`attn_hilbert::generate_counted`).

/// An integer vector `[x, y, z]`.
type V = [i64; 3];

#[inline(always)]
fn add(a: V, b: V) -> V {
    [a[0] + b[0], a[1] + b[1], a[2] + b[2]]
}
#[inline(always)]
fn sub(a: V, b: V) -> V {
    [a[0] - b[0], a[1] - b[1], a[2] - b[2]]
}
#[inline(always)]
fn neg(a: V) -> V {
    [-a[0], -a[1], -a[2]]
}
/// The unit step along an axis vector.
#[inline(always)]
fn unit(a: V) -> V {
    [a[0].signum(), a[1].signum(), a[2].signum()]
}
/// Length of an axis vector (only one component is non-zero).
#[inline(always)]
fn len(a: V) -> i64 {
    a[0].abs() + a[1].abs() + a[2].abs()
}
/// `a / q` rounded toward zero.
#[inline(always)]
fn div(a: V, q: i64) -> V {
    [a[0] / q, a[1] / q, a[2] / q]
}
/// `a / q` rounded toward zero, then nudged one step outward when its length has
/// the wrong parity (`want_odd`) and the axis is longer than 2.
#[inline(always)]
fn div_parity(a: V, q: i64, want_odd: bool) -> V {
    let d = div(a, q);
    if len(a) > 2 && ((len(d) % 2 == 1) != want_odd) { add(d, unit(a)) } else { d }
}
/// A cut of `a` near its middle (within 40%..60%) at a multiple of the largest
/// possible power of two (at least 2), closest to the middle among those; for
/// short axes or when no such multiple exists, [`half_even`]. Adds its loop
/// iterations to `steps` (`O(log len)`; summed over the walk, still `O(n)`).
fn half_aligned(a: V, steps: &mut u64) -> V {
    let l = len(a);
    if l <= 4 {
        return half_even(a);
    }
    let (lo, hi) = ((2 * l + 4) / 5, (3 * l) / 5);
    let mut step = 1i64 << (63 - l.leading_zeros());
    while step >= 2 {
        *steps += 1;
        let first = (lo + step - 1) / step * step;
        if first <= hi {
            let mut m = first;
            let mut best = first;
            while m <= hi {
                *steps += 1;
                if (2 * m - l).abs() < (2 * best - l).abs() {
                    best = m;
                }
                m += step;
            }
            return scale(unit(a), best);
        }
        step /= 2;
    }
    half_even(a)
}
#[inline(always)]
fn half_even(a: V) -> V {
    div_parity(a, 2, false)
}
#[inline(always)]
fn half_odd(a: V) -> V {
    div_parity(a, 2, true)
}
#[inline(always)]
fn third_even(a: V) -> V {
    div_parity(a, 3, false)
}

/// Collects row-major indices of the visited cells.
struct Walk<'a> {
    out: &'a mut Vec<usize>,
    /// Row-major strides of x, y, z.
    stride: [i64; 3],
    /// Emit small boxes from [`SmallCurves`] instead of recursing.
    tables: Option<&'static SmallCurves>,
    /// Work counter: one per recursive call and per [`half_aligned`] loop
    /// iteration. Everything else a call does is `O(1)` or one write per cell.
    steps: u64,
}

/// Smallest power-of-two tile a 2D sub-rectangle switches to aligned cuts for.
const MIN_SUB_TILE: i64 = 2;

/// Largest side of a rectangle (2D) or box (3D) served from a table.
const TABLE_2D: i64 = 8;
const TABLE_3D: i64 = 4;

/// The curves of every small rectangle and box, as offsets in their own
/// `(alpha, beta, gamma)` frame. The recursion is invariant under that frame, so
/// a small call at any position and orientation is a table lookup (the bottom
/// levels dominate the call count: this makes generation about twice as fast).
struct SmallCurves {
    /// Indexed by `(a - 1) * TABLE_2D + (b - 1)`.
    d2: Vec<Vec<[i64; 2]>>,
    /// Indexed by `((a - 1) * TABLE_3D + (b - 1)) * TABLE_3D + (g - 1)`.
    d3: Vec<Vec<[i64; 3]>>,
}

impl SmallCurves {
    fn get() -> &'static SmallCurves {
        static TABLES: std::sync::OnceLock<SmallCurves> = std::sync::OnceLock::new();
        TABLES.get_or_init(|| {
            // Record each curve by recursion (tables off), with 16 as the stride base.
            let record = |f: &dyn Fn(&mut Walk<'_>)| {
                let mut out = Vec::new();
                f(&mut Walk { out: &mut out, stride: [1, 16, 256], tables: None, steps: 0 });
                out.into_iter().map(|i| [i as i64 % 16, i as i64 / 16 % 16, i as i64 / 256]).collect::<Vec<_>>()
            };
            let mut d2 = vec![];
            for a in 1..=TABLE_2D {
                for b in 1..=TABLE_2D {
                    let cells = record(&|w| w.curve_2d([0; 3], [a, 0, 0], [0, b, 0]));
                    d2.push(cells.into_iter().map(|c| [c[0], c[1]]).collect());
                }
            }
            let mut d3 = vec![];
            for a in 1..=TABLE_3D {
                for b in 1..=TABLE_3D {
                    for g in 1..=TABLE_3D {
                        d3.push(record(&|w| w.curve_3d([0; 3], [a, 0, 0], [0, b, 0], [0, 0, g])));
                    }
                }
            }
            SmallCurves { d2, d3 }
        })
    }
}

impl Walk<'_> {
    #[inline(always)]
    fn emit(&mut self, p: V) {
        let i = p[0] * self.stride[0] + p[1] * self.stride[1] + p[2] * self.stride[2];
        self.out.push(i as usize);
    }

    /// `count` cells from `p` in steps of `step` (a unit vector).
    #[inline(always)]
    fn line(&mut self, p: V, step: V, count: i64) {
        let start = p[0] * self.stride[0] + p[1] * self.stride[1] + p[2] * self.stride[2];
        let d = step[0] * self.stride[0] + step[1] * self.stride[1] + step[2] * self.stride[2];
        self.out.extend((0..count).map(|k| (start + k * d) as usize));
    }

    /// Row-major offset of a vector.
    #[inline(always)]
    fn offset(&self, v: V) -> i64 {
        v[0] * self.stride[0] + v[1] * self.stride[1] + v[2] * self.stride[2]
    }

    fn curve_2d(&mut self, p: V, alpha: V, beta: V) {
        self.steps += 1;
        let (a, b) = (len(alpha), len(beta));
        if a == 0 || b == 0 {
            return;
        }
        if let Some(t) = self.tables
            && a <= TABLE_2D
            && b <= TABLE_2D
        {
            let (base, sa, sb) = (self.offset(p), self.offset(unit(alpha)), self.offset(unit(beta)));
            let cells = &t.d2[((a - 1) * TABLE_2D + (b - 1)) as usize];
            self.out.extend(cells.iter().map(|&[i, j]| (base + i * sa + j * sb) as usize));
            return;
        }
        if b == 1 {
            return self.line(p, unit(alpha), a);
        }
        if a == 1 {
            return self.line(p, unit(beta), b);
        }
        let u = common_pow2(&[a, b]);
        if u >= MIN_SUB_TILE && a / u >= 2 && b / u >= 2 {
            return self.aligned_2d(p, alpha, beta, None, u);
        }
        if 2 * a > 3 * b {
            // Long rectangle: two halves side by side along alpha.
            let alpha2 = half_aligned(alpha, &mut self.steps);
            self.curve_2d(p, alpha2, beta);
            self.curve_2d(add(p, alpha2), sub(alpha, alpha2), beta);
            return;
        }
        // Up along the first half of beta, across, and back down.
        let (da, db) = (unit(alpha), unit(beta));
        let alpha2 = if a > 4 { half_aligned(alpha, &mut self.steps) } else { div(alpha, 2) };
        let beta2 = half_aligned(beta, &mut self.steps);
        self.curve_2d(p, beta2, alpha2);
        self.curve_2d(add(p, beta2), alpha, sub(beta, beta2));
        let back = add(p, add(sub(alpha, da), sub(beta2, db)));
        self.curve_2d(back, neg(beta2), sub(alpha2, alpha));
    }

    fn cube_2x2x2(&mut self, p: V, alpha: V, beta: V, gamma: V) {
        let (da, db, dg) = (unit(alpha), unit(beta), unit(gamma));
        let mut u = p;
        self.emit(u);
        for step in [db, dg, neg(db), da, db, neg(dg), neg(db)] {
            u = add(u, step);
            self.emit(u);
        }
    }

    fn curve_3d(&mut self, p: V, alpha: V, beta: V, gamma: V) {
        self.steps += 1;
        let (a, b, g) = (len(alpha), len(beta), len(gamma));
        if a == 0 || b == 0 || g == 0 {
            return;
        }
        if let Some(t) = self.tables
            && a <= TABLE_3D
            && b <= TABLE_3D
            && g <= TABLE_3D
        {
            let base = self.offset(p);
            let (sa, sb, sg) = (self.offset(unit(alpha)), self.offset(unit(beta)), self.offset(unit(gamma)));
            let cells = &t.d3[(((a - 1) * TABLE_3D + (b - 1)) * TABLE_3D + (g - 1)) as usize];
            self.out.extend(cells.iter().map(|&[i, j, k]| (base + i * sa + j * sb + k * sg) as usize));
            return;
        }
        if a == 2 && b == 2 && g == 2 {
            return self.cube_2x2x2(p, alpha, beta, gamma);
        }
        if a == 1 {
            return self.curve_2d(p, beta, gamma);
        }
        if b == 1 {
            return self.curve_2d(p, alpha, gamma);
        }
        if g == 1 {
            return self.curve_2d(p, alpha, beta);
        }
        if 3 * a > 5 * b && 3 * a > 5 * g {
            return self.split_alpha(p, alpha, beta, gamma);
        }
        if 2 * b > 3 * g || 2 * b > 3 * a {
            return self.split_beta_third(p, alpha, beta, gamma);
        }
        if 2 * g > 3 * b {
            return self.split_gamma_third(p, alpha, beta, gamma);
        }
        if g % 2 == 0 {
            return self.bulk_even_gamma(p, alpha, beta, gamma);
        }
        if a % 2 == 0 || b % 2 == 0 {
            return self.bulk_odd_gamma(p, alpha, beta, gamma);
        }
        self.bulk_all_odd(p, alpha, beta, gamma)
    }

    /// Eccentric box, alpha longest by far: two boxes along alpha.
    fn split_alpha(&mut self, p: V, alpha: V, beta: V, gamma: V) {
        let alpha2 = half_even(alpha);
        self.curve_3d(p, alpha2, beta, gamma);
        self.curve_3d(add(p, alpha2), sub(alpha, alpha2), beta, gamma);
    }

    /// Gamma much longer than beta: a third of gamma up, across, and back.
    fn split_gamma_third(&mut self, p: V, alpha: V, beta: V, gamma: V) {
        let (da, dg) = (unit(alpha), unit(gamma));
        let alpha2 = half_even(alpha);
        let gamma3 = third_even(gamma);
        self.curve_3d(p, gamma3, alpha2, beta);
        self.curve_3d(add(p, gamma3), alpha, beta, sub(gamma, gamma3));
        let back = add(p, add(sub(alpha, da), sub(gamma3, dg)));
        self.curve_3d(back, neg(gamma3), neg(sub(alpha, alpha2)), beta);
    }

    /// Beta long (against gamma or alpha): a third of beta, across, and back.
    fn split_beta_third(&mut self, p: V, alpha: V, beta: V, gamma: V) {
        let (da, db) = (unit(alpha), unit(beta));
        let alpha2 = half_even(alpha);
        let beta3 = third_even(beta);
        self.curve_3d(p, beta3, gamma, alpha2);
        self.curve_3d(add(p, beta3), alpha, sub(beta, beta3), gamma);
        let back = add(p, add(sub(alpha, da), sub(beta3, db)));
        self.curve_3d(back, neg(beta3), gamma, neg(sub(alpha, alpha2)));
    }

    /// Bulk box with even gamma: five sub-boxes, all halves even.
    fn bulk_even_gamma(&mut self, p: V, alpha: V, beta: V, gamma: V) {
        let (da, db, dg) = (unit(alpha), unit(beta), unit(gamma));
        let (alpha2, beta2, gamma2) = (half_even(alpha), half_even(beta), half_even(gamma));
        let (rest_a, rest_b, rest_g) = (sub(alpha, alpha2), sub(beta, beta2), sub(gamma, gamma2));
        self.curve_3d(p, beta2, gamma2, alpha2);
        self.curve_3d(add(p, beta2), gamma, alpha2, rest_b);
        self.curve_3d(add(p, add(sub(beta2, db), sub(gamma, dg))), alpha, neg(beta2), neg(rest_g));
        let far = add(sub(alpha, da), add(beta2, sub(gamma, dg)));
        self.curve_3d(add(p, far), neg(gamma), neg(rest_a), rest_b);
        self.curve_3d(add(p, add(sub(alpha, da), sub(beta2, db))), neg(beta2), gamma2, neg(rest_a));
    }

    /// Bulk box with odd gamma and an even alpha or beta: alpha halved to odd.
    fn bulk_odd_gamma(&mut self, p: V, alpha: V, beta: V, gamma: V) {
        let (da, db, dg) = (unit(alpha), unit(beta), unit(gamma));
        let (alpha2, beta2, gamma2) = (half_odd(alpha), half_even(beta), half_even(gamma));
        let (rest_a, rest_b, rest_g) = (sub(alpha, alpha2), sub(beta, beta2), sub(gamma, gamma2));
        self.curve_3d(p, gamma2, alpha2, beta2);
        self.curve_3d(add(p, gamma2), beta, rest_g, alpha2);
        self.curve_3d(add(p, add(sub(gamma2, dg), sub(beta, db))), alpha, neg(rest_b), neg(gamma2));
        let far = add(sub(alpha, da), add(sub(beta, db), gamma2));
        self.curve_3d(add(p, far), neg(beta), rest_g, neg(rest_a));
        self.curve_3d(add(p, add(sub(alpha, da), sub(gamma2, dg))), neg(gamma2), neg(rest_a), beta2);
    }

    /// Bulk box with all three sides odd.
    fn bulk_all_odd(&mut self, p: V, alpha: V, beta: V, gamma: V) {
        let (da, db, dg) = (unit(alpha), unit(beta), unit(gamma));
        let (alpha2, beta2, gamma2) = (half_odd(alpha), half_even(beta), half_even(gamma));
        let (rest_a, rest_b, rest_g) = (sub(alpha, alpha2), sub(beta, beta2), sub(gamma, gamma2));
        self.curve_3d(p, beta2, gamma, alpha2);
        self.curve_3d(add(p, beta2), gamma2, alpha, rest_b);
        self.curve_3d(add(p, add(beta2, gamma2)), alpha, rest_b, rest_g);
        let far = add(sub(alpha, da), add(sub(beta2, db), gamma2));
        self.curve_3d(add(p, far), neg(beta2), rest_g, neg(rest_a));
        self.curve_3d(add(p, add(sub(alpha, da), sub(gamma2, dg))), neg(gamma2), neg(rest_a), beta2);
    }
}

impl Walk<'_> {
    /// [`Walk::curve_2d`] on a rectangle whose sides are multiples of the power
    /// of two `u`, cutting only at multiples of `u` wherever the cut pieces are at
    /// least one `u x u` tile wide, so that aligned tiles are visited whole (a
    /// standard Hilbert curve each) and segments of `u*u` tokens are squares.
    /// With `thick = Some(c)` the rectangle is a slab `u` cells thick along `c`
    /// and its tiles are `u x u x u` cubes (used by [`Walk::aligned_3d`]).
    fn aligned_2d(&mut self, p: V, alpha: V, beta: V, thick: Option<V>, u: i64) {
        self.steps += 1;
        let (ac, bc) = (len(alpha) / u, len(beta) / u);
        if u == 1 || (ac == 1 && bc == 1) {
            return self.leaf(p, alpha, beta, thick);
        }
        let (ca, cb) = (div(alpha, u), div(beta, u));
        if 2 * ac > 3 * bc {
            let alpha2 = scale(half_even(ca), u);
            self.aligned_2d(p, alpha2, beta, thick, u);
            self.aligned_2d(add(p, alpha2), sub(alpha, alpha2), beta, thick, u);
            return;
        }
        if ac == 1 {
            // A one-tile-wide strip must go up and come back inside the strip.
            return self.leaf(p, alpha, beta, thick);
        }
        let (da, db) = (unit(alpha), unit(beta));
        let alpha2 = scale(div(ca, 2), u);
        let beta2 = scale(half_even(cb), u);
        self.aligned_2d(p, beta2, alpha2, thick, u);
        self.aligned_2d(add(p, beta2), alpha, sub(beta, beta2), thick, u);
        let back = add(p, add(sub(alpha, da), sub(beta2, db)));
        self.aligned_2d(back, neg(beta2), sub(alpha2, alpha), thick, u);
    }

    /// The unaligned curve on a rectangle, or on a slab `thick` cells thick.
    fn leaf(&mut self, p: V, alpha: V, beta: V, thick: Option<V>) {
        match thick {
            None => self.curve_2d(p, alpha, beta),
            Some(c) => self.curve_3d(p, alpha, beta, c),
        }
    }

    /// [`Walk::curve_3d`] on a box whose sides are multiples of `u` (as
    /// [`Walk::aligned_2d`]). A box one tile thick along beta or gamma is a slab
    /// of tiles; one tile thick along alpha (the curve must come back next to its
    /// start) falls back to the unaligned curve.
    fn aligned_3d(&mut self, p: V, alpha: V, beta: V, gamma: V, u: i64) {
        self.steps += 1;
        let (ac, bc, gc) = (len(alpha) / u, len(beta) / u, len(gamma) / u);
        if u == 1 || ac == 1 {
            return self.curve_3d(p, alpha, beta, gamma);
        }
        if gc == 1 {
            return self.aligned_2d(p, alpha, beta, Some(gamma), u);
        }
        if bc == 1 {
            return self.aligned_2d(p, alpha, gamma, Some(beta), u);
        }
        let (ca, cb, cg) = (div(alpha, u), div(beta, u), div(gamma, u));
        let (da, db, dg) = (unit(alpha), unit(beta), unit(gamma));
        let s = |v: V| scale(v, u);
        if 3 * ac > 5 * bc && 3 * ac > 5 * gc {
            let alpha2 = s(half_even(ca));
            self.aligned_3d(p, alpha2, beta, gamma, u);
            self.aligned_3d(add(p, alpha2), sub(alpha, alpha2), beta, gamma, u);
        } else if 2 * bc > 3 * gc || 2 * bc > 3 * ac {
            let (alpha2, beta3) = (s(half_even(ca)), s(third_even(cb)));
            self.aligned_3d(p, beta3, gamma, alpha2, u);
            self.aligned_3d(add(p, beta3), alpha, sub(beta, beta3), gamma, u);
            let back = add(p, add(sub(alpha, da), sub(beta3, db)));
            self.aligned_3d(back, neg(beta3), gamma, neg(sub(alpha, alpha2)), u);
        } else if 2 * gc > 3 * bc {
            let (alpha2, gamma3) = (s(half_even(ca)), s(third_even(cg)));
            self.aligned_3d(p, gamma3, alpha2, beta, u);
            self.aligned_3d(add(p, gamma3), alpha, beta, sub(gamma, gamma3), u);
            let back = add(p, add(sub(alpha, da), sub(gamma3, dg)));
            self.aligned_3d(back, neg(gamma3), neg(sub(alpha, alpha2)), beta, u);
        } else if gc % 2 == 0 {
            let (alpha2, beta2, gamma2) = (s(half_even(ca)), s(half_even(cb)), s(half_even(cg)));
            let (rest_a, rest_b, rest_g) = (sub(alpha, alpha2), sub(beta, beta2), sub(gamma, gamma2));
            self.aligned_3d(p, beta2, gamma2, alpha2, u);
            self.aligned_3d(add(p, beta2), gamma, alpha2, rest_b, u);
            self.aligned_3d(add(p, add(sub(beta2, db), sub(gamma, dg))), alpha, neg(beta2), neg(rest_g), u);
            let far = add(sub(alpha, da), add(beta2, sub(gamma, dg)));
            self.aligned_3d(add(p, far), neg(gamma), neg(rest_a), rest_b, u);
            self.aligned_3d(add(p, add(sub(alpha, da), sub(beta2, db))), neg(beta2), gamma2, neg(rest_a), u);
        } else if ac % 2 == 0 || bc % 2 == 0 {
            let (alpha2, beta2, gamma2) = (s(half_odd(ca)), s(half_even(cb)), s(half_even(cg)));
            let (rest_a, rest_b, rest_g) = (sub(alpha, alpha2), sub(beta, beta2), sub(gamma, gamma2));
            self.aligned_3d(p, gamma2, alpha2, beta2, u);
            self.aligned_3d(add(p, gamma2), beta, rest_g, alpha2, u);
            self.aligned_3d(add(p, add(sub(gamma2, dg), sub(beta, db))), alpha, neg(rest_b), neg(gamma2), u);
            let far = add(sub(alpha, da), add(sub(beta, db), gamma2));
            self.aligned_3d(add(p, far), neg(beta), rest_g, neg(rest_a), u);
            self.aligned_3d(add(p, add(sub(alpha, da), sub(gamma2, dg))), neg(gamma2), neg(rest_a), beta2, u);
        } else {
            let (alpha2, beta2, gamma2) = (s(half_odd(ca)), s(half_even(cb)), s(half_even(cg)));
            let (rest_a, rest_b, rest_g) = (sub(alpha, alpha2), sub(beta, beta2), sub(gamma, gamma2));
            self.aligned_3d(p, beta2, gamma, alpha2, u);
            self.aligned_3d(add(p, beta2), gamma2, alpha, rest_b, u);
            self.aligned_3d(add(p, add(beta2, gamma2)), alpha, rest_b, rest_g, u);
            let far = add(sub(alpha, da), add(sub(beta2, db), gamma2));
            self.aligned_3d(add(p, far), neg(beta2), rest_g, neg(rest_a), u);
            self.aligned_3d(add(p, add(sub(alpha, da), sub(gamma2, dg))), neg(gamma2), neg(rest_a), beta2, u);
        }
    }
}

#[inline(always)]
fn scale(a: V, u: i64) -> V {
    [a[0] * u, a[1] * u, a[2] * u]
}

/// The largest power of two dividing every length.
fn common_pow2(lens: &[i64]) -> i64 {
    let tz = lens.iter().map(|l| l.trailing_zeros()).min().unwrap_or(0);
    1i64 << tz.min(62)
}

/// Appends to `out` the row-major indices (`(z * height + y) * width + x`) of a
/// `depth x height x width` box in generalised Hilbert order. The caller checks
/// that the sizes are non-zero and that `depth * height * width` is at most
/// [`crate::grid::MAX_TOKENS`]; `out` receives exactly that many indices.
///
/// Axes of length 1 are dropped; the curve runs first along the longest even
/// axis, or the longest axis when all are odd (ties: width, then height, then
/// depth), and cuts at multiples of the largest power of two dividing every
/// remaining side (see [`Walk::aligned_2d`]). Returns the walk's step count
/// ([`Walk::steps`]).
pub(crate) fn hilbert_indices(depth: usize, height: usize, width: usize, out: &mut Vec<usize>) -> u64 {
    let (d, h, w) = (depth as i64, height as i64, width as i64);
    let mut walk = Walk { out, stride: [1, w, w * h], tables: Some(SmallCurves::get()), steps: 0 };
    let mut axes: Vec<V> = [[w, 0, 0], [0, h, 0], [0, 0, d]].into_iter().filter(|a| len(*a) > 1).collect();
    axes.sort_by_key(|a| std::cmp::Reverse(len(*a))); // stable: ties keep width first
    let lens: Vec<i64> = axes.iter().map(|a| len(*a)).collect();
    let u = common_pow2(&lens);
    // The curve ends next to its start along the first axis; when that axis is
    // odd and the cell count even, parity forces a diagonal step. Leading with
    // the longest axis that is even in tiles of `u` (when there is one) avoids it,
    // for the cells and for the tiles.
    if let Some(i) = axes.iter().position(|a| (len(*a) / u) % 2 == 0) {
        let even = axes.remove(i);
        axes.insert(0, even);
    }
    match axes[..] {
        [] => walk.emit([0, 0, 0]),
        [a] => walk.line([0, 0, 0], unit(a), len(a)),
        [a, b] => walk.aligned_2d([0, 0, 0], a, b, None, u),
        [a, b, c, ..] => walk.aligned_3d([0, 0, 0], a, b, c, u),
    }
    walk.steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn both(depth: i64, height: i64, width: i64) -> (Vec<usize>, Vec<usize>) {
        let run = |tables| {
            let mut out = vec![];
            let mut walk = Walk { out: &mut out, stride: [1, width, width * height], tables, steps: 0 };
            walk.aligned_3d([0; 3], [width, 0, 0], [0, height, 0], [0, 0, depth], 1);
            out
        };
        (run(None), run(Some(SmallCurves::get())))
    }

    #[test]
    fn tables_reproduce_the_recursion() {
        for h in 1..=24 {
            for w in 1..=24 {
                let (slow, fast) = both(1, h, w);
                assert_eq!(slow, fast, "{h}x{w}");
            }
        }
        for d in 1..=9 {
            for h in 1..=9 {
                for w in 1..=9 {
                    let (slow, fast) = both(d, h, w);
                    assert_eq!(slow, fast, "{d}x{h}x{w}");
                }
            }
        }
    }
}
