// The harness's judge: the row bound of attn-testkit (each output row and LSE against the
// float64 reference within its dtype's bound) and the errors `--plant` puts into a case's
// results, which the judge must reject.
#pragma once

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "reference.hpp"

enum class DT { F32, F16, BF16 };

// ---- judging ------------------------------------------------------------------------------
static double rel_l2(const std::vector<float>& got, const std::vector<double>& want) {
    if (got.size() != want.size() || want.empty()) return INFINITY;
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

static double lse_err(const std::vector<float>& got, const std::vector<double>& want) {
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isinf(want[i]) || std::isinf(got[i])) {
            if (!(std::isinf(want[i]) && std::isinf(got[i]))) return INFINITY;
            continue;
        }
        worst = std::max(worst, std::abs(got[i] - want[i]) / (1 + std::abs(want[i])));
    }
    return worst;
}

// The row bound's constants of one stored dtype (attn-testkit's RowBound): f32 noise of
// 256 unit roundoffs, plus the dtype's unit roundoff and its smallest subnormal.
struct RowBound {
    double rel, floor;
};

static RowBound row_bound(DT dt) {
    const double noise = 256 * std::ldexp(1.0, -24);
    if (dt == DT::F16) return {std::ldexp(1.0, -11) + noise, std::ldexp(1.0, -24)};
    if (dt == DT::BF16) return {std::ldexp(1.0, -8) + noise, std::ldexp(1.0, -133)};
    return {noise, 0};
}

// The error of row `row` (D values) over its bound rel * (|want| + |magnitude|) +
// floor * sqrt(D); infinite where a value is not finite.
static double row_ratio(const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& mag,
                        size_t row, int D, RowBound b) {
    double err = 0, w = 0, m = 0;
    for (size_t e = row * D; e < (row + 1) * D; ++e) {
        if (!std::isfinite(got[e])) return INFINITY;
        err += (got[e] - want[e]) * (got[e] - want[e]);
        w += want[e] * want[e];
        m += mag[e] * mag[e];
    }
    if (err == 0) return 0;
    const double bound = b.rel * (std::sqrt(w) + std::sqrt(m)) + b.floor * std::sqrt((double)D);
    return bound > 0 ? std::sqrt(err) / bound : INFINITY;
}

// The worst row's ratio (pass: <= 1); a size mismatch or an empty tensor is infinite.
static double worst_row(const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& mag,
                        int D, RowBound b) {
    if (got.size() != want.size() || mag.size() != want.size() || want.empty() || want.size() % D) return INFINITY;
    double worst = 0;
    for (size_t r = 0; r < want.size() / D; ++r) worst = std::max(worst, row_ratio(got, want, mag, r, D, b));
    return worst;
}

// One LSE's error over 64 f32 unit roundoffs of (magnitude + 1); equal infinities agree.
static double lse_ratio(float got, double want, double mag) {
    if (std::isinf(want) && got == want) return 0;
    if (!std::isfinite(got) || !std::isfinite(want)) return INFINITY;
    return std::abs(got - want) / (64 * std::ldexp(1.0, -24) * (mag + 1));
}

static double worst_lse(const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& mag) {
    if (got.size() != want.size() || mag.size() != want.size() || want.empty()) return INFINITY;
    double worst = 0;
    for (size_t r = 0; r < want.size(); ++r) worst = std::max(worst, lse_ratio(got[r], want[r], mag[r]));
    return worst;
}


// Swaps two rows of out that differ (the first and the last with a nonzero reference) and
// moves the first finite LSE by 0.01; true when the row judge rejects both.
static bool planted_rejected(const std::string& name, std::vector<float> out, std::vector<float> lse, const Ref& ref,
                             int D, DT dt) {
    const size_t rows = ref.out.size() / D;
    auto nonzero = [&](size_t r) {
        for (int e = 0; e < D; ++e)
            if (ref.out[r * D + e] != 0) return true;
        return false;
    };
    size_t a = 0, z = rows - 1;
    while (a < rows && !nonzero(a)) ++a;
    while (z > a && !nonzero(z)) --z;
    size_t l = 0;
    while (l < lse.size() && !std::isfinite(ref.lse[l])) ++l;
    if (z <= a || l == lse.size()) {
        std::printf("FAIL %-58s planted: no two nonzero rows or no finite LSE to plant in\n", name.c_str());
        return false;
    }
    for (int e = 0; e < D; ++e) std::swap(out[a * D + e], out[z * D + e]);
    lse[l] += 0.01f;
    const RowBound b = row_bound(dt);
    const double r_out = row_ratio(out, ref.out, ref.mout, a, D, b), r_lse = lse_ratio(lse[l], ref.lse[l], ref.mlse[l]);
    const bool rejected = worst_row(out, ref.out, ref.mout, D, b) > 1 && worst_lse(lse, ref.lse, ref.mlse) > 1;
    std::printf("%-4s %-58s planted: out rows %zu<->%zu at %.1f of the bound (whole tensor %.2e), lse row %zu at %.1f\n",
                rejected && r_out > 1 && r_lse > 1 ? "ok" : "FAIL", name.c_str(), a, z, r_out, rel_l2(out, ref.out), l, r_lse);
    return rejected && r_out > 1 && r_lse > 1;
}

// Swaps the first and the last row of `grad` whose reference rows differ; true when the
// row judge rejects the result (the rows' gradients put where the other's belong).
static bool planted_grad_rejected(const char* what, std::vector<float> grad, const std::vector<double>& want,
                                  const std::vector<double>& mag, int D, DT dt, std::string* line) {
    const size_t rows = want.size() / D;
    auto differ = [&](size_t x, size_t y) {
        for (int e = 0; e < D; ++e)
            if (want[x * D + e] != want[y * D + e]) return true;
        return false;
    };
    size_t a = 0, z = rows - 1;
    while (z > a && !differ(a, z)) --z;
    if (z <= a) {
        *line += std::string(" ") + what + ": no two different rows";
        return false;
    }
    for (int e = 0; e < D; ++e) std::swap(grad[a * D + e], grad[z * D + e]);
    const double r = worst_row(grad, want, mag, D, row_bound(dt));
    char buf[96];
    std::snprintf(buf, sizeof buf, " %s rows %zu<->%zu at %.1f", what, a, z, r);
    *line += buf;
    return r > 1;
}

