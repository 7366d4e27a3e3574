#include "keel/vector/index.h"

#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVFFlat.h>
#include <faiss/IndexIVFPQ.h>
#include <faiss/impl/FaissException.h>
#include <faiss/impl/IDSelector.h>
#include <faiss/impl/io.h>
#include <faiss/index_io.h>
#include <faiss/utils/distances.h>
#include <omp.h>
#include <faiss/utils/random.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>

#include "keel/core/log.h"
#include "keel/vector/records.h"

namespace keel::vector {

namespace {

using FaissIdx = faiss::Index::idx_t;

constexpr char kMagic[8] = {'K', 'V', 'I', 'D', 'X', '0', '0', '1'};

// Skips tombstones and, when given, labels the caller's predicate rejects.
struct LabelSelector : faiss::IDSelector {
  const std::vector<uint8_t>* live = nullptr;
  const std::function<bool(int64_t)>* accept = nullptr;
  bool is_member(idx_t id) const override {
    if (id < 0 || static_cast<size_t>(id) >= live->size() || (*live)[id] == 0) return false;
    return accept == nullptr || (*accept)(id);
  }
};


// Debian's FAISS links the reference BLAS, whose sgemm is slower than FAISS's own AVX2 distance
// kernels: with the BLAS path off, IVF training and bulk adds ran 1.7x faster (100k items,
// 1024 lists). Process-wide FAISS setting; single queries never took the BLAS path anyway.
void PreferFaissKernels() {
  static std::once_flag once;
  std::call_once(once, [] { faiss::distance_compute_blas_threshold = 1 << 30; });
}

}  // namespace

Result<std::unique_ptr<TextIndex>> TextIndex::Create(const IndexOptions& options, int dim) {
  if (dim < 1 || dim > 65536) return Status::InvalidArgument("index: dimension " + std::to_string(dim) + " out of [1, 65536]");
  PreferFaissKernels();
  std::unique_ptr<TextIndex> ix(new TextIndex(options, dim));
  switch (options.kind) {
    case IndexKind::kHnsw: {
      if (options.hnsw_m < 2 || options.hnsw_m > 256) return Status::InvalidArgument("index: hnsw M must be in [2, 256]");
      if (options.hnsw_ef_construction < 1 || options.hnsw_ef_search < 1) {
        return Status::InvalidArgument("index: hnsw ef_construction and ef_search must be >= 1");
      }
      auto h = std::make_unique<faiss::IndexHNSWFlat>(dim, options.hnsw_m);
      h->hnsw.efConstruction = options.hnsw_ef_construction;
      h->hnsw.efSearch = options.hnsw_ef_search;
      h->hnsw.rng = faiss::RandomGenerator(options.hnsw_seed);
      ix->index_ = std::move(h);
      ix->trained_ = true;
      break;
    }
    case IndexKind::kIvfPq:
      if (options.pq_m < 1 || dim % options.pq_m != 0) {
        return Status::InvalidArgument("index: pq_m " + std::to_string(options.pq_m) + " must divide the dimension " + std::to_string(dim));
      }
      if (options.pq_bits < 1 || options.pq_bits > 16) return Status::InvalidArgument("index: pq_bits must be in [1, 16]");
      [[fallthrough]];
    case IndexKind::kIvfFlat:
      if (options.ivf_lists < 1 || options.ivf_lists > (1 << 20)) return Status::InvalidArgument("index: ivf lists must be in [1, 2^20]");
      if (options.ivf_nprobe < 1) return Status::InvalidArgument("index: ivf nprobe must be >= 1");
      ix->index_ = std::make_unique<faiss::IndexFlatL2>(dim);
      break;
  }
  return ix;
}

TextIndex::TextIndex(const IndexOptions& options, int dim) : options_(options), dim_(dim) {}
TextIndex::~TextIndex() = default;

int64_t TextIndex::TrainSize() const {
  if (options_.kind == IndexKind::kHnsw) return 0;
  // 39 points per centroid is FAISS's own floor for k-means; PQ's sub-quantizers need as many
  // per code.
  int64_t n = int64_t{39} * options_.ivf_lists;
  if (options_.kind == IndexKind::kIvfPq) n = std::max<int64_t>(n, int64_t{39} << options_.pq_bits);
  return n;
}

Status TextIndex::Add(const float* x, int64_t n, bool defer_training) {
  if (n <= 0) return Status::Ok();
  // FAISS links HNSW vertices from several OpenMP threads, and which thread wins a neighbour list
  // changes the graph: a replica replaying its write-ahead log, or a peer applying the same
  // writes, could then answer a query differently. One thread makes the graph a function of the
  // writes and the level seed alone (inserts get up to 2x slower on 2 cores; searches are not
  // affected).
  const bool one_thread = options_.kind == IndexKind::kHnsw;
  const int threads = omp_get_max_threads();
  if (one_thread) omp_set_num_threads(1);
  try {
    index_->add(n, x);
  } catch (const faiss::FaissException& e) {
    if (one_thread) omp_set_num_threads(threads);
    return Status::Internal(std::string("index: add failed: ") + e.what());
  }
  if (one_thread) omp_set_num_threads(threads);
  live_.resize(live_.size() + n, 1);
  if (!defer_training && NeedsTraining()) return Train();
  return Status::Ok();
}

Status TextIndex::Train() {
  KEEL_RETURN_IF_ERROR(BuildTrained());
  InstallTrained();
  return Status::Ok();
}

void TextIndex::InstallTrained() {
  if (!pending_) return;
  index_ = std::move(pending_);
  lists_ = pending_lists_;
  trained_ = true;
}

Status TextIndex::BuildTrained() {
  auto* flat = dynamic_cast<faiss::IndexFlat*>(index_.get());
  if (flat == nullptr) return Status::Internal("index: untrained IVF without its flat buffer");
  const int64_t n = flat->ntotal;
  const float* x = flat->get_xb();
  const int lists = static_cast<int>(std::clamp<int64_t>(n / 39, 1, options_.ivf_lists));
  try {
    auto* quantizer = new faiss::IndexFlatL2(dim_);
    std::unique_ptr<faiss::IndexIVF> ivf;
    if (options_.kind == IndexKind::kIvfPq) {
      ivf = std::make_unique<faiss::IndexIVFPQ>(quantizer, dim_, lists, options_.pq_m, options_.pq_bits);
    } else {
      ivf = std::make_unique<faiss::IndexIVFFlat>(quantizer, dim_, lists);
    }
    ivf->own_fields = true;
    ivf->nprobe = std::min(options_.ivf_nprobe, lists);
    ivf->cp.max_points_per_centroid = 256;
    // k-means converges well before FAISS's default 25 iterations on embedding data; training
    // runs inside an Upsert, so keep it short (recall on SIFT is unchanged at 10).
    ivf->cp.niter = 10;
    const auto t0 = std::chrono::steady_clock::now();
    ivf->train(n, x);
    ivf->add(n, x);
    pending_ = std::move(ivf);
    pending_lists_ = lists;
    Log().info("index: trained {} lists on {} vectors in {} ms", lists, n,
               std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count());
  } catch (const faiss::FaissException& e) {
    return Status::Internal(std::string("index: IVF training failed: ") + e.what());
  }
  return Status::Ok();
}

void TextIndex::Tombstone(int64_t label) {
  if (label < 0 || label >= size() || live_[label] == 0) return;
  live_[label] = 0;
  ++tombstones_;
}

bool TextIndex::IsLive(int64_t label) const { return label >= 0 && label < size() && live_[label] != 0; }

Result<std::vector<IndexHit>> TextIndex::Search(const float* q, const IndexSearchParams& params) const {
  std::vector<IndexHit> hits;
  if (params.k < 1) return Status::InvalidArgument("index: k must be >= 1");
  if (live() == 0) return hits;
  LabelSelector sel;
  sel.live = &live_;
  sel.accept = params.accept;
  const bool need_sel = tombstones_ > 0 || params.accept != nullptr;

  // Exact scan over stored vectors, for what the ANN structure cannot answer well.
  auto exact = [&](const float* xb) {
    std::vector<IndexHit> all;
    for (int64_t i = 0; i < size(); ++i) {
      if (need_sel && !sel.is_member(i)) continue;
      all.push_back({i, faiss::fvec_L2sqr(q, xb + i * dim_, dim_)});
    }
    const size_t k = std::min<size_t>(params.k, all.size());
    auto by_dist = [](const IndexHit& a, const IndexHit& b) {
      return a.distance < b.distance || (a.distance == b.distance && a.label < b.label);
    };
    std::partial_sort(all.begin(), all.begin() + k, all.end(), by_dist);
    all.resize(k);
    return all;
  };
  // The untrained IVF buffer is small by construction (< TrainSize vectors).
  if (!trained_) return exact(static_cast<const faiss::IndexFlat*>(index_.get())->get_xb());

  const int k = static_cast<int>(std::min<int64_t>(params.k, size()));
  std::vector<float> dist(k);
  std::vector<FaissIdx> labels(k, -1);
  try {
    if (options_.kind == IndexKind::kHnsw) {
      faiss::SearchParametersHNSW p;
      p.efSearch = std::max(params.ef > 0 ? params.ef : options_.hnsw_ef_search, k);
      p.sel = need_sel ? &sel : nullptr;
      index_->search(1, q, k, dist.data(), labels.data(), &p);
    } else {
      faiss::SearchParametersIVF p;
      p.nprobe = static_cast<size_t>(std::min(params.nprobe > 0 ? params.nprobe : options_.ivf_nprobe, lists_));
      p.sel = need_sel ? &sel : nullptr;
      index_->search(1, q, k, dist.data(), labels.data(), &p);
    }
  } catch (const faiss::FaissException& e) {
    return Status::Internal(std::string("index: search failed: ") + e.what());
  }
  for (int i = 0; i < k; ++i) {
    if (labels[i] < 0) continue;
    hits.push_back({labels[i], dist[i]});
  }
  if (params.accept != nullptr && static_cast<int64_t>(hits.size()) < std::min<int64_t>(k, live())) {
    // A selective filter starves the graph walk (HNSW) or the probed lists (IVF) of matches.
    // HNSW: scan its flat storage exactly; IVF: probe every list. Both cost O(n), only here.
    if (auto* h = dynamic_cast<const faiss::IndexHNSWFlat*>(index_.get())) {
      return exact(static_cast<const faiss::IndexFlat*>(h->storage)->get_xb());
    }
    if (params.nprobe < lists_) {
      IndexSearchParams wide = params;
      wide.nprobe = lists_;
      return Search(q, wide);
    }
  }
  return hits;
}

Result<std::string> TextIndex::Save() const {
  faiss::VectorIOWriter w;
  try {
    faiss::write_index(index_.get(), &w);
  } catch (const faiss::FaissException& e) {
    return Status::Internal(std::string("index: serialise failed: ") + e.what());
  }
  std::string out(kMagic, sizeof(kMagic));
  PutPod(&out, static_cast<uint32_t>(options_.kind));
  PutPod(&out, static_cast<uint32_t>(dim_));
  PutPod(&out, static_cast<uint32_t>(trained_));
  PutPod(&out, static_cast<uint32_t>(lists_));
  PutPod(&out, static_cast<uint64_t>(live_.size()));
  out.append(reinterpret_cast<const char*>(live_.data()), live_.size());
  PutPod(&out, static_cast<uint64_t>(w.data.size()));
  out.append(reinterpret_cast<const char*>(w.data.data()), w.data.size());
  return out;
}

Result<std::unique_ptr<TextIndex>> TextIndex::Load(const IndexOptions& options, int dim, std::string_view bytes) {
  auto bad = [](const std::string& why) { return Status::Corruption("index: " + why); };
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) return bad("bad magic");
  bytes.remove_prefix(sizeof(kMagic));
  uint32_t kind = 0, d = 0, trained = 0, lists = 0;
  uint64_t n = 0, faiss_len = 0;
  if (!GetPod(&bytes, &kind) || !GetPod(&bytes, &d) || !GetPod(&bytes, &trained) || !GetPod(&bytes, &lists) || !GetPod(&bytes, &n)) {
    return bad("truncated header");
  }
  if (kind > static_cast<uint32_t>(IndexKind::kIvfPq)) return bad("unknown index kind " + std::to_string(kind));
  if (kind != static_cast<uint32_t>(options.kind)) {
    return Status::InvalidArgument("index: stored index is " + std::string(IndexKindName(static_cast<IndexKind>(kind))) +
                                   ", options ask for " + std::string(IndexKindName(options.kind)));
  }
  if (static_cast<int>(d) != dim) return bad("stored dimension " + std::to_string(d) + " != " + std::to_string(dim));
  if (bytes.size() < n) return bad("truncated tombstone map");
  KEEL_ASSIGN_OR_RETURN(auto ix, Create(options, dim));
  ix->live_.assign(bytes.begin(), bytes.begin() + n);
  bytes.remove_prefix(n);
  ix->tombstones_ = std::count(ix->live_.begin(), ix->live_.end(), uint8_t{0});
  if (!GetPod(&bytes, &faiss_len) || bytes.size() != faiss_len) return bad("faiss section length mismatch");
  faiss::VectorIOReader r;
  r.data.assign(bytes.begin(), bytes.end());
  try {
    ix->index_.reset(faiss::read_index(&r));
  } catch (const faiss::FaissException& e) {
    return bad(std::string("faiss index does not load: ") + e.what());
  }
  if (ix->index_->d != dim || static_cast<uint64_t>(ix->index_->ntotal) != n) {
    return bad("faiss index holds " + std::to_string(ix->index_->ntotal) + " vectors, expected " + std::to_string(n));
  }
  ix->trained_ = trained != 0;
  ix->lists_ = static_cast<int>(lists);
  if (auto* h = dynamic_cast<faiss::IndexHNSWFlat*>(ix->index_.get())) {
    h->hnsw.efSearch = options.hnsw_ef_search;
    // FAISS does not store the level generator; vectors added after a restart draw from the seed.
    h->hnsw.rng = faiss::RandomGenerator(options.hnsw_seed);
  }
  return ix;
}

}  // namespace keel::vector
