// The rules of a run folder (`kiln train --out DIR`): one kiln process writes there at a time
// (RunLock: DIR/.kiln-lock under flock, holding the writer's pid), checkpoint temporaries left
// by a killed writer are removed when the next run starts there, and a resumed run writes only
// into its own run folder or an empty one (never into another run's files).
#pragma once
#include <cstdint>
#include <string>

namespace kiln::train {

class RunLock {
 public:
  // Takes the lock of run folder `dir`, creating the folder when absent (and removing the folders
  // it created when it is released with them still empty). kiln::Error "DIR is in use by pid N"
  // while another live process holds it. A lock whose process died is free again: flock locks
  // go with their process, so a killed run leaves no lock behind.
  explicit RunLock(const std::string& dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  static constexpr const char* kFileName = ".kiln-lock";

 private:
  std::string dir_, path_;
  std::string created_;  // the top-most folder this lock created ("" when `dir` existed)
  int fd_ = -1;
};

// The pid of the live process holding `dir`'s lock; 0 when none does.
int64_t run_folder_holder(const std::string& dir);

// Removes the checkpoint temporaries in run folder `dir` whose writer is no longer alive
// (.tmp-NAME-PID and .old-NAME-PID folders of write_dir_atomic, .latest.tmp) and returns a
// note naming them and their size ("" when there were none). Call it with the lock held.
std::string remove_stale_temporaries(const std::string& dir);

// Refuses `out` as the folder of a run resumed from checkpoint `ckpt_dir` unless it is that
// checkpoint's run folder (or the checkpoint itself) or holds no run: a resume into another
// run's folder rewrote its metrics and repointed its `latest`.
void check_resume_out(const std::string& ckpt_dir, const std::string& out);

// The job that last prepared run folder `dir`: kiln train's rank 0 writes DIR/.kiln-job (the
// job's id, the same for every rank and every restart of one job) once it has checked the folder,
// so a restarted rank knows whether the folder's files are its own job's. "" when there is none.
std::string run_folder_job(const std::string& dir);
void mark_run_folder_job(const std::string& dir, const std::string& job);
inline constexpr const char* kJobFileName = ".kiln-job";

}  // namespace kiln::train
