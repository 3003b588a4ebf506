// Flight-recorder analysis (fr_analyze.h).
#include "kiln/dist/fr_analyze.h"

#include <dirent.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "kiln/core/error.h"

namespace kiln::dist {
namespace {

struct Entry {
  int64_t seq;
  std::string op, dtype, state;
  int64_t in_numel, out_numel;
};

// One communicator (a name and a generation) as the dumps see it.
struct Comm {
  std::string name;
  int generation = 0;
  int size = 0;
  std::vector<int> members;                            // the job's rank of each rank; -1: not known
  std::map<int, std::map<int64_t, Entry>> ranks;       // comm rank -> seq -> entry, for ranks with a dump
};

// A dump's field, checked: a hand-edited or cut dump is an error naming the field, not a crash.
const json::Value& field(const json::Value& j, const char* key, const char* where) {
  const json::Value* v = j.find(key);
  KILN_CHECK(v != nullptr, "comms analyze: ", where, " has no \"", key, "\"");
  return *v;
}
int64_t int_field(const json::Value& j, const char* key, const char* where, int64_t dflt = INT64_MIN) {
  const json::Value* v = j.find(key);
  if (!v && dflt != INT64_MIN) return dflt;
  return field(j, key, where).as_int(key);
}

class Namer {
 public:
  explicit Namer(const Comm& c) : c_(c) {}
  // "rank 1", "ranks 0, 2"; a comm rank whose job rank differs says so: "rank 1 (job rank 3)".
  std::string list(const std::vector<int>& ranks) const {
    std::ostringstream s;
    s << (ranks.size() == 1 ? "rank " : "ranks ");
    for (size_t i = 0; i < ranks.size(); ++i) {
      s << (i ? ", " : "") << ranks[i];
      const int g = ranks[i] < static_cast<int>(c_.members.size()) ? c_.members[static_cast<size_t>(ranks[i])] : -1;
      if (g >= 0 && g != ranks[i]) s << " (job rank " << g << ")";
    }
    return s.str();
  }

 private:
  const Comm& c_;
};

// Groups ranks by a field's value: "rank 0 has 8, ranks 1, 2 have 16".
template <class F>
std::string by_value(const Namer& nm, const std::map<int, const Entry*>& at, F field_of) {
  std::map<std::string, std::vector<int>> groups;
  for (auto& [r, e] : at) groups[field_of(*e)].push_back(r);
  std::string out;
  for (auto& [v, rs] : groups)
    out += (out.empty() ? "" : ", ") + nm.list(rs) + (rs.size() == 1 ? " has " : " have ") + v;
  return out;
}

json::Value int_array(const std::vector<int>& v) {
  json::Value a = json::Value::array();
  for (int x : v) a.push_back(static_cast<int64_t>(x));
  return a;
}

}  // namespace

FrAnalysis analyze_flight_records(const std::vector<json::Value>& dumps) {
  std::map<std::pair<std::string, int>, Comm> comms;
  auto comm_of = [&](const std::string& name, int gen, int size) -> Comm& {
    Comm& c = comms[{name, gen}];
    c.name = name;
    c.generation = gen;
    c.size = std::max(c.size, size);
    if (static_cast<int>(c.members.size()) < c.size) c.members.resize(static_cast<size_t>(c.size), -1);
    return c;
  };
  std::set<int> dumped;     // job ranks with a dump
  std::set<int64_t> world_sizes;
  for (const auto& d : dumps) {
    const int job_rank = static_cast<int>(int_field(d, "rank", "a dump", -1));
    if (job_rank >= 0) {
      KILN_CHECK(dumped.insert(job_rank).second, "comms analyze: two dumps say they are rank ", job_rank);
    }
    if (const json::Value* w = d.find("world_size")) world_sizes.insert(w->as_int("world_size"));
    // The communicators this rank joined (dumps of version 2 on): their size and members.
    if (const json::Value* cs = d.find("comms")) {
      for (const auto& j : cs->as_array("comms")) {
        const int size = static_cast<int>(int_field(j, "size", "a \"comms\" item"));
        const int r = static_cast<int>(int_field(j, "rank", "a \"comms\" item"));
        KILN_CHECK(size >= 1 && size <= (1 << 20) && r >= 0 && r < size, "comms analyze: communicator '",
                   field(j, "comm", "a \"comms\" item").as_string("comm"), "' has rank ", r, " of size ", size);
        Comm& c = comm_of(field(j, "comm", "a \"comms\" item").as_string("comm"),
                          static_cast<int>(int_field(j, "generation", "a \"comms\" item", 0)), size);
        if (const json::Value* m = j.find("ranks")) {
          const auto& ms = m->as_array("ranks");
          for (size_t i = 0; i < ms.size() && i < c.members.size(); ++i)
            if (ms[i].as_int("ranks") >= 0) c.members[i] = static_cast<int>(ms[i].as_int("ranks"));
        }
        if (job_rank >= 0) c.members[static_cast<size_t>(r)] = job_rank;
        c.ranks[r];  // a member with a dump, even if it recorded no op of this communicator
      }
    }
    for (const auto& j : field(d, "entries", "a dump").as_array("entries")) {
      const char* where = "an entry";
      Entry e{int_field(j, "seq", where), field(j, "op", where).as_string("op"),
              field(j, "dtype", where).as_string("dtype"), field(j, "state", where).as_string("state"),
              int_field(j, "in_numel", where), int_field(j, "out_numel", where)};
      const int size = static_cast<int>(int_field(j, "comm_size", where));
      const int r = static_cast<int>(int_field(j, "comm_rank", where));
      KILN_CHECK(size >= 1 && size <= (1 << 20) && r >= 0 && r < size, "comms analyze: an entry of '",
                 field(j, "comm", where).as_string("comm"), "' has comm_rank ", r, " of comm_size ", size);
      Comm& c = comm_of(field(j, "comm", where).as_string("comm"),
                        static_cast<int>(int_field(j, "generation", where, 0)), size);
      if (job_rank >= 0 && c.members[static_cast<size_t>(r)] < 0) c.members[static_cast<size_t>(r)] = job_rank;
      c.ranks[r][e.seq] = e;
    }
  }
  // The job's size: what the dumps say (version 2 on); older dumps: the largest first-generation
  // communicator.
  int64_t world = world_sizes.empty() ? 0 : *world_sizes.rbegin();
  if (world_sizes.empty())
    for (auto& [k, c] : comms)
      if (c.generation == 0) world = std::max<int64_t>(world, c.size);
  std::vector<int> world_missing;
  for (int r = 0; r < world && r < (1 << 20); ++r)
    if (!dumped.count(r)) world_missing.push_back(r);

  FrAnalysis out;
  out.report = json::Value::object();
  out.report["dumps"] = static_cast<int64_t>(dumps.size());
  out.report["world_size"] = world;
  json::Value list = json::Value::array();
  std::ostringstream text;
  for (auto& [key, cm] : comms) {
    const Comm& comm = cm;
    const std::string& name = comm.name;
    const auto& ranks = comm.ranks;
    const int size = comm.size;
    const Namer nm(comm);
    json::Value c = json::Value::object();
    c["comm"] = name;
    c["generation"] = comm.generation;
    c["size"] = size;
    c["members"] = int_array(comm.members);
    std::vector<int> no_dump;
    for (int r = 0; r < size; ++r)
      if (!ranks.count(r)) no_dump.push_back(r);
    int64_t lo = 0, hi = 0;
    for (auto& [r, entries] : ranks) {
      if (entries.empty()) continue;
      lo = std::max(lo, entries.begin()->first);
      hi = std::max(hi, entries.rbegin()->first);
    }
    const std::string of_comm = " of '" + name + "'" + (comm.generation ? " generation " + std::to_string(comm.generation) : "");
    json::Value finding;  // null: none
    auto make = [&](const char* kind, int64_t seq, const std::string& op, const std::string& msg,
                    const std::vector<int>& who) {
      finding = json::Value::object();
      finding["kind"] = kind;
      finding["seq"] = seq;
      finding["op"] = op;
      finding["ranks"] = int_array(who);
      finding["message"] = msg;
    };
    const std::string left = no_dump.empty() ? "" : nm.list(no_dump) + " left no dump";
    for (int64_t seq = lo; seq <= hi && hi > 0 && finding.is_null(); ++seq) {
      std::map<int, const Entry*> at;
      std::vector<int> absent;  // ranks with a dump but no entry for seq
      for (auto& [r, entries] : ranks) {
        auto it = entries.find(seq);
        if (it == entries.end()) absent.push_back(r);
        else at[r] = &it->second;
      }
      if (at.empty()) continue;
      const Entry& first = *at.begin()->second;
      const std::string where = "#" + std::to_string(seq) + of_comm;
      if (!absent.empty()) {
        make("missing_ranks", seq, first.op,
             nm.list(absent) + " never joined " + first.op + " " + where + (left.empty() ? "" : "; " + left), absent);
        continue;
      }
      std::set<std::string> ops, counts, dtypes;
      for (auto& [r, e] : at) {
        ops.insert(e->op);
        counts.insert(std::to_string(e->in_numel) + "/" + std::to_string(e->out_numel));
        dtypes.insert(e->dtype);
      }
      std::vector<int> all;
      for (auto& [r, e] : at) all.push_back(r);
      if (ops.size() > 1) {
        make("op_mismatch", seq, first.op,
             "op mismatch at " + where + ": " + by_value(nm, at, [](const Entry& e) { return e.op; }), all);
      } else if (counts.size() > 1) {
        make("size_mismatch", seq, first.op,
             "size mismatch at " + first.op + " " + where + ": " + by_value(nm, at, [](const Entry& e) {
               return std::to_string(e.in_numel) + " -> " + std::to_string(e.out_numel) + " elements";
             }),
             all);
      } else if (dtypes.size() > 1) {
        make("dtype_mismatch", seq, first.op,
             "dtype mismatch at " + first.op + " " + where + ": " +
                 by_value(nm, at, [](const Entry& e) { return e.dtype; }),
             all);
      } else {
        std::vector<int> unfinished;
        for (auto& [r, e] : at)
          if (e->state != "completed") unfinished.push_back(r);
        if (unfinished.empty()) continue;
        const std::string states = by_value(nm, at, [](const Entry& e) { return "state " + e.state; });
        if (!no_dump.empty())
          // The ranks with a dump all reached this op and waited in it: the ranks without one are
          // the ones it waited for (they never joined it, or died).
          make("no_dump", seq, first.op,
               nm.list(no_dump) + " never joined " + first.op + " " + where + " (" +
                   (no_dump.size() == 1 ? "it" : "they") + " left no dump; " + states + ")",
               no_dump);
        else
          make("not_completed", seq, first.op,
               "every rank joined " + first.op + " " + where + " but it did not complete on " + states, unfinished);
      }
    }
    if (finding.is_null() && !no_dump.empty())
      make("no_dump", hi, "", left + "; " + (hi > 0 ? "the others completed every op through #" + std::to_string(hi) + of_comm
                                                 : "the others recorded no op" + of_comm),
           no_dump);
    c["first_mismatch"] = finding;
    json::Value last = json::Value::object();
    std::string last_text;
    for (int r = 0; r < size; ++r) {
      auto it = ranks.find(r);
      if (it == ranks.end()) {
        last_text += (last_text.empty() ? "" : ", ") + nm.list({r}) + ": no dump";
        continue;
      }
      int64_t done = 0;
      for (auto& [seq, e] : it->second)
        if (e.state == "completed") done = std::max(done, seq);
      last[std::to_string(r)] = done;
      last_text += (last_text.empty() ? "" : ", ") + nm.list({r}) + " #" + std::to_string(done);
    }
    c["last_completed"] = std::move(last);
    c["ranks_without_dump"] = int_array(no_dump);
    text << "comm '" << name << "'" << (comm.generation ? " generation " + std::to_string(comm.generation) : "")
         << " (" << size << " ranks, ";
    if (hi > 0) text << "ops #" << lo << " to #" << hi << "): ";
    else text << "no ops recorded): ";
    if (finding.is_null()) {
      text << (hi > 0 ? "every rank ran the same ops, all completed\n" : "nothing to compare\n");
    } else {
      text << finding.find("message")->as_string() << "\n";
      out.ok = false;
    }
    text << "  last completed: " << last_text << "\n";
    list.push_back(std::move(c));
  }
  if (comms.empty()) text << "no operations recorded in " << dumps.size() << " dump(s)\n";
  if (world_sizes.size() > 1) {
    text << "the dumps disagree on the world size:";
    for (int64_t w : world_sizes) text << " " << w;
    text << " (dumps of different jobs in one folder?)\n";
    out.ok = false;
  }
  for (int r : world_missing) text << "rank " << r << " left no dump (never joined / died?)\n";
  if (!world_missing.empty()) out.ok = false;
  out.report["ranks_without_dump"] = int_array(world_missing);
  out.report["comms"] = std::move(list);
  out.report["ok"] = out.ok;
  out.text = text.str();
  return out;
}

FrAnalysis analyze_dump_dir(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  KILN_CHECK(d != nullptr, "comms analyze: cannot open folder '", dir, "'");
  std::vector<std::string> files;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind("kiln_fr_rank", 0) == 0 && n.size() > 5 && n.substr(n.size() - 5) == ".json") files.push_back(n);
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  KILN_CHECK(!files.empty(), "comms analyze: no flight-recorder dumps (kiln_fr_rank<R>.json) in '", dir, "'");
  std::vector<json::Value> dumps;
  for (const auto& f : files) {
    std::ifstream in(dir + "/" + f);
    std::stringstream ss;
    ss << in.rdbuf();
    try {
      json::Value v = json::parse(ss.str());
      KILN_CHECK(v.is_object() && v.contains("entries"), "not a flight-recorder dump (no \"entries\")");
      dumps.push_back(std::move(v));
    } catch (const Error& e) {
      fail("comms analyze: ", dir, "/", f, ": ", e.what());
    }
  }
  try {
    return analyze_flight_records(dumps);
  } catch (const Error& e) {
    fail(e.what(), " (in the dumps of '", dir, "')");
  }
}

}  // namespace kiln::dist
