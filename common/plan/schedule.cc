#include "common/plan/schedule.h"

#include <algorithm>
#include <queue>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/plan/synthetic_batch.h"

namespace hetpar::plan {
namespace {

double SampleEncoderCost(const SampleDescriptor& s, const CostModel& encoder_cost) {
  return static_cast<double>(s.image_count()) * encoder_cost.Cost(s.tokens_per_image);
}

double Imbalance(const std::vector<double>& loads) {
  if (loads.empty()) return 1.0;
  double total = 0;
  double max = 0;
  for (double load : loads) {
    total += load;
    max = std::max(max, load);
  }
  if (total <= 0) return 1.0;
  return max / (total / static_cast<double>(loads.size()));
}

}  // namespace

bool operator==(const LlmMicrobatch& a, const LlmMicrobatch& b) {
  return a.replica == b.replica && a.wave == b.wave && a.samples == b.samples &&
         a.tokens == b.tokens && a.image_rows == b.image_rows && a.loss_tokens == b.loss_tokens &&
         a.cost == b.cost;
}

bool operator==(const LlmAssignment& a, const LlmAssignment& b) {
  return a.replicas == b.replicas && a.waves == b.waves && a.micro_batch == b.micro_batch &&
         a.microbatches == b.microbatches && a.sample_replica == b.sample_replica &&
         a.sample_wave == b.sample_wave && a.replica_cost == b.replica_cost &&
         a.imbalance == b.imbalance;
}

bool operator==(const ImageRef& a, const ImageRef& b) {
  return a.sample == b.sample && a.image == b.image;
}

bool operator==(const EncoderJob& a, const EncoderJob& b) {
  return a.replica == b.replica && a.wave == b.wave && a.images == b.images &&
         a.row_offsets == b.row_offsets && a.rows == b.rows && a.cost == b.cost;
}

bool operator==(const EncoderAssignment& a, const EncoderAssignment& b) {
  return a.replicas == b.replicas && a.waves == b.waves && a.jobs == b.jobs &&
         a.image_base == b.image_base && a.image_job == b.image_job &&
         a.image_row_offset == b.image_row_offset && a.replica_cost == b.replica_cost &&
         a.step_imbalance == b.step_imbalance && a.worst_wave_imbalance == b.worst_wave_imbalance &&
         a.mean_wave_imbalance == b.mean_wave_imbalance;
}

absl::StatusOr<LlmAssignment> AssignLlm(const std::vector<SampleDescriptor>& samples,
                                        int64_t replicas, int64_t waves, int64_t micro_batch,
                                        const CostModel& llm_cost, const CostModel& encoder_cost,
                                        uint64_t seed, int64_t step) {
  if (replicas < 1 || waves < 1 || micro_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("LLM assignment needs llm dp, waves and micro_batch >= 1; got dp=", replicas,
                     " waves=", waves, " micro_batch=", micro_batch));
  }
  const int64_t batch = static_cast<int64_t>(samples.size());
  // Microbatches of micro_batch samples, `waves` for each of the first `full` replicas and one
  // fewer for the others: all replicas take the same waves unless some left the run.
  const int64_t microbatches = batch / micro_batch;
  const int64_t full = microbatches - (waves - 1) * replicas;
  if (batch % micro_batch != 0 || full < 1 || full > replicas || (waves == 1 && full != replicas)) {
    const int64_t least = std::max(replicas, (waves - 1) * replicas + 1);
    return absl::InvalidArgumentError(absl::StrCat(
        "the global batch has ", batch, " samples; expected micro_batch ", micro_batch, " x ",
        least == waves * replicas ? absl::StrCat(least)
                                  : absl::StrCat(least, " to ", waves * replicas),
        " microbatches for ", waves, " waves over llm dp ", replicas,
        " (a replica may take one wave fewer)"));
  }
  std::vector<int64_t> replica_waves(replicas, waves);
  for (int64_t d = full; d < replicas; ++d) replica_waves[d] = waves - 1;
  std::vector<double> cost(batch);
  std::vector<double> enc(batch);
  std::vector<uint64_t> tie(batch);
  for (int64_t i = 0; i < batch; ++i) {
    cost[i] = llm_cost.Cost(samples[i].sequence_length());
    enc[i] = SampleEncoderCost(samples[i], encoder_cost);
    tie[i] = HashValues(seed, static_cast<uint64_t>(step), static_cast<uint64_t>(samples[i].id));
  }

  LlmAssignment out;
  out.replicas = replicas;
  out.waves = waves;
  out.micro_batch = micro_batch;
  out.sample_replica.assign(batch, -1);
  out.sample_wave.assign(batch, -1);
  out.replica_cost.assign(replicas, 0.0);

  // Replicas: LPT with a capacity of their waves x micro_batch samples each.
  std::vector<int64_t> order(batch);
  for (int64_t i = 0; i < batch; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (cost[a] != cost[b]) return cost[a] > cost[b];
    if (tie[a] != tie[b]) return tie[a] < tie[b];
    return a < b;
  });
  using Load = std::pair<double, int64_t>;  // (cost so far, replica)
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> open;
  for (int64_t d = 0; d < replicas; ++d) open.push({0.0, d});
  std::vector<int64_t> count(replicas, 0);
  for (int64_t i : order) {
    const auto [load, d] = open.top();
    open.pop();
    out.sample_replica[i] = d;
    out.replica_cost[d] = load + cost[i];
    if (++count[d] < replica_waves[d] * micro_batch) open.push({out.replica_cost[d], d});
  }

  // Waves: most encoder work first, each to the wave with the least encoder work (then LLM
  // cost) over all replicas among the waves where its replica still has room.
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (enc[a] != enc[b]) return enc[a] > enc[b];
    if (cost[a] != cost[b]) return cost[a] > cost[b];
    if (tie[a] != tie[b]) return tie[a] < tie[b];
    return a < b;
  });
  std::vector<double> wave_enc(waves, 0.0);
  std::vector<double> wave_llm(waves, 0.0);
  std::vector<int64_t> filled(replicas * waves, 0);
  // A wave's work per replica taking it: a last wave of only `full` replicas counts its work as
  // the others' would be with every replica in it.
  const auto load = [&](int64_t m) {
    const double scale = m + 1 == waves && full < replicas
                             ? static_cast<double>(replicas) / static_cast<double>(full)
                             : 1.0;
    return std::make_pair(wave_enc[m] * scale, wave_llm[m] * scale);
  };
  for (int64_t i : order) {
    const int64_t d = out.sample_replica[i];
    int64_t best = -1;
    for (int64_t m = 0; m < replica_waves[d]; ++m) {
      if (filled[d * waves + m] >= micro_batch) continue;
      if (best < 0 || load(m) < load(best)) best = m;
    }
    out.sample_wave[i] = best;
    ++filled[d * waves + best];
    wave_enc[best] += enc[i];
    wave_llm[best] += cost[i];
  }

  out.microbatches.resize(replicas * waves);
  for (int64_t d = 0; d < replicas; ++d) {
    for (int64_t m = 0; m < waves; ++m) {
      LlmMicrobatch& mb = out.microbatches[d * waves + m];
      mb.replica = d;
      mb.wave = m;
      mb.samples.reserve(micro_batch);
    }
  }
  for (int64_t i = 0; i < batch; ++i) {
    LlmMicrobatch& mb = out.microbatches[out.sample_replica[i] * waves + out.sample_wave[i]];
    mb.samples.push_back(i);
    mb.tokens += samples[i].sequence_length();
    mb.image_rows += samples[i].image_tokens();
    mb.loss_tokens += samples[i].loss_tokens;
    mb.cost += cost[i];
  }
  out.imbalance = Imbalance(out.replica_cost);
  return out;
}

std::pair<int64_t, int64_t> EncoderAssignment::JobsOf(int64_t replica) const {
  auto begin = std::lower_bound(jobs.begin(), jobs.end(), replica,
                                [](const EncoderJob& j, int64_t r) { return j.replica < r; });
  auto end = std::upper_bound(begin, jobs.end(), replica,
                              [](int64_t r, const EncoderJob& j) { return r < j.replica; });
  return {begin - jobs.begin(), end - jobs.begin()};
}

const EncoderJob* EncoderAssignment::Find(int64_t replica, int64_t wave) const {
  auto it = std::lower_bound(jobs.begin(), jobs.end(), std::make_pair(replica, wave),
                             [](const EncoderJob& j, const std::pair<int64_t, int64_t>& key) {
                               return std::make_pair(j.replica, j.wave) < key;
                             });
  if (it == jobs.end() || it->replica != replica || it->wave != wave) return nullptr;
  return &*it;
}

absl::StatusOr<EncoderAssignment> AssignEncoder(const std::vector<SampleDescriptor>& samples,
                                                const LlmAssignment& llm, int64_t replicas,
                                                const CostModel& encoder_cost, uint64_t seed,
                                                int64_t step) {
  if (replicas < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("encoder assignment needs encoder dp >= 1; got ", replicas));
  }
  const int64_t batch = static_cast<int64_t>(samples.size());
  if (static_cast<int64_t>(llm.sample_wave.size()) != batch ||
      static_cast<int64_t>(llm.microbatches.size()) != llm.replicas * llm.waves) {
    return absl::InvalidArgumentError(absl::StrCat("encoder assignment: the LLM assignment covers ",
                                                   llm.sample_wave.size(),
                                                   " samples; the batch has ", batch));
  }
  for (const LlmMicrobatch& mb : llm.microbatches) {
    for (int64_t s : mb.samples) {
      if (s < 0 || s >= batch || llm.sample_wave[s] != mb.wave) {
        return absl::InvalidArgumentError(
            absl::StrCat("encoder assignment: LLM microbatch (replica ", mb.replica, ", wave ",
                         mb.wave, ") lists batch position ", s, ", which is outside the batch of ",
                         batch, " or assigned to another wave"));
      }
    }
  }
  EncoderAssignment out;
  out.replicas = replicas;
  out.waves = llm.waves;
  out.image_base.resize(batch + 1, 0);
  for (int64_t i = 0; i < batch; ++i) {
    out.image_base[i + 1] = out.image_base[i] + samples[i].image_count();
  }
  const int64_t total_images = out.image_base[batch];
  std::vector<int64_t> image_replica(total_images, -1);
  out.replica_cost.assign(replicas, 0.0);

  struct Candidate {
    double cost;
    uint64_t tie;
    int64_t flat;
  };
  std::vector<Candidate> wave_images;
  std::vector<double> wave_load(replicas, 0.0);
  double imbalance_sum = 0;
  int64_t waves_with_images = 0;
  using Key = std::tuple<double, double, int64_t>;  // (wave load, step load, replica)
  std::vector<Key> heap;
  heap.reserve(replicas);
  for (int64_t m = 0; m < llm.waves; ++m) {
    wave_images.clear();
    for (int64_t d = 0; d < llm.replicas; ++d) {
      for (int64_t s : llm.At(d, m).samples) {
        const SampleDescriptor& sample = samples[s];
        const double c = encoder_cost.Cost(sample.tokens_per_image);
        for (int64_t k = 0; k < sample.image_count(); ++k) {
          wave_images.push_back(
              {c,
               HashValues(seed, static_cast<uint64_t>(step), static_cast<uint64_t>(sample.id),
                          static_cast<uint64_t>(k)),
               out.image_base[s] + k});
        }
      }
    }
    if (wave_images.empty()) continue;
    std::sort(wave_images.begin(), wave_images.end(), [](const Candidate& a, const Candidate& b) {
      if (a.cost != b.cost) return a.cost > b.cost;
      if (a.tie != b.tie) return a.tie < b.tie;
      return a.flat < b.flat;
    });
    heap.clear();
    for (int64_t e = 0; e < replicas; ++e) heap.emplace_back(0.0, out.replica_cost[e], e);
    std::make_heap(heap.begin(), heap.end(), std::greater<Key>());
    std::fill(wave_load.begin(), wave_load.end(), 0.0);
    for (const Candidate& image : wave_images) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<Key>());
      auto& [load, step_load, e] = heap.back();
      image_replica[image.flat] = e;
      load += image.cost;
      step_load += image.cost;
      wave_load[e] = load;
      out.replica_cost[e] = step_load;
      std::push_heap(heap.begin(), heap.end(), std::greater<Key>());
    }
    const double imbalance = Imbalance(wave_load);
    imbalance_sum += imbalance;
    ++waves_with_images;
    out.worst_wave_imbalance =
        waves_with_images == 1 ? imbalance : std::max(out.worst_wave_imbalance, imbalance);
  }
  out.mean_wave_imbalance =
      waves_with_images > 0 ? imbalance_sum / static_cast<double>(waves_with_images) : 1.0;
  out.step_imbalance = Imbalance(out.replica_cost);

  // Jobs, sorted by (replica, wave), images in (sample, image) order.
  struct Entry {
    int64_t replica;
    int64_t wave;
    int64_t flat;
  };
  std::vector<int64_t> flat_sample(total_images);
  std::vector<Entry> entries;
  entries.reserve(total_images);
  for (int64_t s = 0; s < batch; ++s) {
    for (int64_t f = out.image_base[s]; f < out.image_base[s + 1]; ++f) {
      flat_sample[f] = s;
      entries.push_back({image_replica[f], llm.sample_wave[s], f});
    }
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.replica, a.wave, a.flat) < std::tie(b.replica, b.wave, b.flat);
  });
  out.image_job.assign(total_images, -1);
  out.image_row_offset.assign(total_images, 0);
  for (const Entry& entry : entries) {
    if (out.jobs.empty() || out.jobs.back().replica != entry.replica ||
        out.jobs.back().wave != entry.wave) {
      EncoderJob job;
      job.replica = entry.replica;
      job.wave = entry.wave;
      out.jobs.push_back(std::move(job));
    }
    EncoderJob& job = out.jobs.back();
    const int64_t s = flat_sample[entry.flat];
    const int64_t tokens = samples[s].tokens_per_image;
    out.image_job[entry.flat] = static_cast<int64_t>(out.jobs.size()) - 1;
    out.image_row_offset[entry.flat] = job.rows;
    job.images.push_back({s, entry.flat - out.image_base[s]});
    job.row_offsets.push_back(job.rows);
    job.rows += tokens;
    job.cost += encoder_cost.Cost(tokens);
  }
  return out;
}

}  // namespace hetpar::plan
