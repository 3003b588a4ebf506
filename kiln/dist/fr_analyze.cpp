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

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  return s.str();
}

// Groups ranks by a field's value: "rank 0 has 8, ranks 1, 2 have 16".
template <class F>
std::string by_value(const std::map<int, const Entry*>& at, F field) {
  std::map<std::string, std::vector<int>> groups;
  for (auto& [r, e] : at) groups[field(*e)].push_back(r);
  std::string out;
  for (auto& [v, rs] : groups)
    out += (out.empty() ? "" : ", ") + rank_list(rs) + (rs.size() == 1 ? " has " : " have ") + v;
  return out;
}

}  // namespace

FrAnalysis analyze_flight_records(const std::vector<json::Value>& dumps) {
  // comm -> comm rank -> seq -> entry
  std::map<std::string, std::map<int, std::map<int64_t, Entry>>> comms;
  std::map<std::string, int> sizes;
  for (const auto& d : dumps) {
    for (const auto& j : d.find("entries") ? d.find("entries")->as_array("entries") : json::Value::Array{}) {
      Entry e{j.find("seq")->as_int("seq"), j.find("op")->as_string("op"), j.find("dtype")->as_string("dtype"),
              j.find("state")->as_string("state"), j.find("in_numel")->as_int("in_numel"),
              j.find("out_numel")->as_int("out_numel")};
      const std::string comm = j.find("comm")->as_string("comm");
      const int r = static_cast<int>(j.find("comm_rank")->as_int("comm_rank"));
      sizes[comm] = std::max(sizes[comm], static_cast<int>(j.find("comm_size")->as_int("comm_size")));
      comms[comm][r][e.seq] = e;
    }
  }
  FrAnalysis out;
  out.report = json::Value::object();
  out.report["dumps"] = static_cast<int64_t>(dumps.size());
  json::Value list = json::Value::array();
  std::ostringstream text;
  for (auto& [name, ranks] : comms) {
    const int size = sizes[name];
    json::Value c = json::Value::object();
    c["comm"] = name;
    c["size"] = size;
    std::vector<int> no_dump;
    for (int r = 0; r < size; ++r)
      if (!ranks.count(r)) no_dump.push_back(r);
    int64_t lo = 0, hi = 0;
    for (auto& [r, entries] : ranks) {
      lo = std::max(lo, entries.begin()->first);
      hi = std::max(hi, entries.rbegin()->first);
    }
    json::Value finding;  // null: none
    for (int64_t seq = lo; seq <= hi && finding.is_null(); ++seq) {
      std::map<int, const Entry*> at;
      std::vector<int> missing;
      for (auto& [r, entries] : ranks) {
        auto it = entries.find(seq);
        if (it == entries.end()) missing.push_back(r);
        else at[r] = &it->second;
      }
      if (at.empty()) continue;
      const Entry& first = *at.begin()->second;
      auto make = [&](const char* kind, const std::string& msg, const std::vector<int>& who) {
        finding = json::Value::object();
        finding["kind"] = kind;
        finding["seq"] = seq;
        finding["op"] = first.op;
        json::Value rs = json::Value::array();
        for (int r : who) rs.push_back(r);
        finding["ranks"] = std::move(rs);
        finding["message"] = msg;
      };
      if (!missing.empty()) {
        make("missing_ranks", rank_list(missing) + " never joined " + first.op + " #" + std::to_string(seq) +
                                  " of '" + name + "'", missing);
        continue;
      }
      std::set<std::string> ops, counts, dtypes;
      for (auto& [r, e] : at) {
        ops.insert(e->op);
        counts.insert(std::to_string(e->in_numel) + "/" + std::to_string(e->out_numel));
        dtypes.insert(e->dtype);
      }
      const std::string where = "#" + std::to_string(seq) + " of '" + name + "'";
      std::vector<int> all;
      for (auto& [r, e] : at) all.push_back(r);
      if (ops.size() > 1) {
        make("op_mismatch", "op mismatch at " + where + ": " + by_value(at, [](const Entry& e) { return e.op; }), all);
      } else if (counts.size() > 1) {
        make("size_mismatch", "size mismatch at " + first.op + " " + where + ": " +
                                  by_value(at, [](const Entry& e) {
                                    return std::to_string(e.in_numel) + " -> " + std::to_string(e.out_numel) +
                                           " elements";
                                  }),
             all);
      } else if (dtypes.size() > 1) {
        make("dtype_mismatch", "dtype mismatch at " + first.op + " " + where + ": " +
                                   by_value(at, [](const Entry& e) { return e.dtype; }), all);
      } else {
        std::vector<int> unfinished;
        for (auto& [r, e] : at)
          if (e->state != "completed") unfinished.push_back(r);
        if (!unfinished.empty())
          make("not_completed", "every rank joined " + first.op + " " + where + " but it did not complete on " +
                                    by_value(at, [](const Entry& e) { return "state " + e.state; }), unfinished);
      }
    }
    c["first_mismatch"] = finding;
    json::Value last = json::Value::object();
    std::string last_text;
    for (auto& [r, entries] : ranks) {
      int64_t done = 0;
      for (auto& [seq, e] : entries)
        if (e.state == "completed") done = std::max(done, seq);
      last[std::to_string(r)] = done;
      last_text += (last_text.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " #" + std::to_string(done);
    }
    c["last_completed"] = std::move(last);
    json::Value nd = json::Value::array();
    for (int r : no_dump) nd.push_back(r);
    c["ranks_without_dump"] = std::move(nd);
    text << "comm '" << name << "' (" << size << " ranks, ops #" << lo << " to #" << hi << "): ";
    if (finding.is_null()) {
      text << "every rank ran the same ops, all completed\n";
    } else {
      text << finding.find("message")->as_string() << "\n";
      out.ok = false;
    }
    text << "  last completed: " << last_text << "\n";
    if (!no_dump.empty()) {
      text << "  no dump from " << rank_list(no_dump) << " (dead before dumping, or dumps from another folder)\n";
      out.ok = false;
    }
    list.push_back(std::move(c));
  }
  if (comms.empty()) text << "no operations recorded in " << dumps.size() << " dump(s)\n";
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
  return analyze_flight_records(dumps);
}

}  // namespace kiln::dist
