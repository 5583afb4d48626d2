// Internal to model/kernels: the vector operations a kernel source writes once
// for every build, included by that source INSIDE its build's namespace, after
// the file's `#pragma GCC target` (no #pragma once: each build has its own
// copy). A function defined before the pragma keeps the default target; with
// these helpers defined there, the AVX-512 kernels that inline them grew by a
// quarter, full of lane-by-lane extractions (valignd, vpextrd), and the f16
// decode attention took 50 % longer.
//
// - select, vcast, vconvert, vload, vstore, vload_halves: a vector select,
//   bit cast, lane-wise conversion, load and store, for native vectors and
//   for pair16.
// - vexp: e^x lane by lane (the attention's softmax, the FFN's SiLU).
// - With STRATA_VEC_PAIR: pair16, 16 lanes held as two vectors of 8, for code
//   built for AVX2, where GCC 12 keeps vec.hpp's 64-byte vectors in memory
//   (see there). Each half is one AVX2 register. Its operators and helpers
//   work half by half, so every lane computes what it computes in a v16: the
//   same bits, whichever of the two a kernel is built with (hsum adds lanes i
//   and i + 8 first, as vec.hpp's does).
//
// Needs <type_traits> and vec.hpp.

template <class T>
struct is_pair16 : std::false_type {};

// A vector of any kind from memory (no alignment assumed); a pair16 half by
// half (one copy into the whole struct went through the stack: two 16-byte
// stores, then a 32-byte load that waits for both).
template <class V>
inline __attribute__((always_inline)) V vload(const void* p) {
  if constexpr (is_pair16<V>::value) {
    using H = decltype(V{}.lo);
    return V{vload<H>(p), vload<H>(static_cast<const char*>(p) + sizeof(H))};
  } else {
    V v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
  }
}
// A vector of any kind to memory (no alignment assumed).
template <class V>
inline __attribute__((always_inline)) void vstore(void* p, V v) {
  if constexpr (is_pair16<V>::value) {
    vstore(p, v.lo);
    vstore(static_cast<char*>(p) + sizeof(v.lo), v.hi);
  } else {
    __builtin_memcpy(p, &v, sizeof v);
  }
}
// Its first half from a, its second from b (zero where b is null).
template <class V>
inline __attribute__((always_inline)) V vload_halves(const void* a, const void* b) {
  if constexpr (is_pair16<V>::value) {
    using H = decltype(V{}.lo);
    return V{vload<H>(a), b ? vload<H>(b) : H{}};
  } else {
    V v{};
    __builtin_memcpy(&v, a, sizeof v / 2);
    if (b)
      __builtin_memcpy(reinterpret_cast<char*>(&v) + sizeof v / 2, b, sizeof v / 2);
    return v;
  }
}
// Lane by lane: a where the mask m is all ones, else b.
template <class M, class V>
inline __attribute__((always_inline)) V select(M m, V a, V b) {
  return m ? a : b;
}
// The same bits as another vector type of the same size.
template <class To, class From>
inline __attribute__((always_inline)) To vcast(From x) {
  return reinterpret_cast<To>(x);
}
// Each lane converted to another element type (as static_cast does).
template <class To, class From>
inline __attribute__((always_inline)) To vconvert(From x) {
  return __builtin_convertvector(x, To);
}

#ifdef STRATA_VEC_PAIR
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));

template <class H>
struct pair16 {
  H lo, hi;
  // Lane i, as a vector's v[i] (GCC's vector types alias their element type).
  using elem = std::remove_reference_t<decltype(H{}[0])>;
  inline __attribute__((always_inline)) elem& operator[](int i) { return reinterpret_cast<elem*>(this)[i]; }
  inline __attribute__((always_inline)) elem operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};

template <class H>
struct is_pair16<pair16<H>> : std::true_type {};

#define STRATA_PAIR_OP(op)                                                                                        \
  template <class A, class B>                                                                                    \
  inline __attribute__((always_inline)) auto operator op(pair16<A> a, pair16<B> b) {                             \
    return pair16<decltype(a.lo op b.lo)>{a.lo op b.lo, a.hi op b.hi};                                            \
  }                                                                                                               \
  template <class A, class S, std::enable_if_t<std::is_arithmetic_v<S>, int> = 0>                                \
  inline __attribute__((always_inline)) auto operator op(pair16<A> a, S b) {                                     \
    return pair16<decltype(a.lo op b)>{a.lo op b, a.hi op b};                                                     \
  }                                                                                                               \
  template <class S, class B, std::enable_if_t<std::is_arithmetic_v<S>, int> = 0>                                \
  inline __attribute__((always_inline)) auto operator op(S a, pair16<B> b) {                                     \
    return pair16<decltype(a op b.lo)>{a op b.lo, a op b.hi};                                                     \
  }
STRATA_PAIR_OP(+)
STRATA_PAIR_OP(-)
STRATA_PAIR_OP(*)
STRATA_PAIR_OP(/)
STRATA_PAIR_OP(&)
STRATA_PAIR_OP(|)
STRATA_PAIR_OP(^)
STRATA_PAIR_OP(<<)
STRATA_PAIR_OP(>>)
STRATA_PAIR_OP(<)
STRATA_PAIR_OP(<=)
STRATA_PAIR_OP(>)
STRATA_PAIR_OP(>=)
STRATA_PAIR_OP(==)
STRATA_PAIR_OP(!=)
#undef STRATA_PAIR_OP

#define STRATA_PAIR_ASSIGN(op)                                                                                    \
  template <class A, class B>                                                                                    \
  inline __attribute__((always_inline)) pair16<A>& operator op##=(pair16<A>& a, B b) {                           \
    a = a op b;                                                                                                   \
    return a;                                                                                                     \
  }
STRATA_PAIR_ASSIGN(+)
STRATA_PAIR_ASSIGN(-)
STRATA_PAIR_ASSIGN(*)
#undef STRATA_PAIR_ASSIGN

template <class A>
inline __attribute__((always_inline)) pair16<A> operator~(pair16<A> a) {
  return {~a.lo, ~a.hi};
}
template <class A>
inline __attribute__((always_inline)) pair16<A> operator-(pair16<A> a) {
  return {-a.lo, -a.hi};
}

template <class M, class H>
inline __attribute__((always_inline)) pair16<H> select(pair16<M> m, pair16<H> a, pair16<H> b) {
  return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi};
}
template <class To, class H>
inline __attribute__((always_inline)) To vcast(pair16<H> x) {
  using T = decltype(To{}.lo);
  return {reinterpret_cast<T>(x.lo), reinterpret_cast<T>(x.hi)};
}
template <class To, class H>
inline __attribute__((always_inline)) To vconvert(pair16<H> x) {
  using T = decltype(To{}.lo);
  return {__builtin_convertvector(x.lo, T), __builtin_convertvector(x.hi, T)};
}

// vec.hpp's order: lanes i and i + 8 (the halves), then i and i + 4, ...
inline __attribute__((always_inline)) float hsum(pair16<v8> v) {
  const v8 a = v.lo + v.hi;
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

#endif

// e^x lane by lane for a float vector V with integer lanes VI (Cephes' expf:
// x = k ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial in r, times 2^k),
// within 2 ulp of expf; 0 below -87.3 (so -inf gives exactly 0; so does NaN);
// above 88.7 as at 88.7 (2^128: infinity). Lane by lane a pure function of its
// input, whatever the vector width.
template <class V, class VI>
inline __attribute__((always_inline)) V vexp(V x) {
  const V lo = V{} - 87.33654f, hi = V{} + 88.72283f;
  const VI under = ~(x >= lo); // NaN too
  x = select(x >= lo, x, lo);
  x = select(x > hi, hi, x);
  // k = round(x / ln2) by the 1.5 * 2^23 trick (|x / ln2| < 2^22).
  const V shifter = V{} + 12582912.0f;
  const V kf = (x * 1.44269504088896341f + shifter) - shifter;
  const V r = x - kf * 0.693359375f - kf * -2.12194440e-4f;
  const V r2 = r * r;
  V p = V{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r2 + r + 1.0f;
  const VI k = vconvert<VI>(kf);
  const V two_k = vcast<V>((k + 127) << 23);
  const V e = p * two_k;
  return select(under, V{}, e);
}
