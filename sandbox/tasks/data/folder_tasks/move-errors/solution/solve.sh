grep -l ERROR logs/*.log
mkdir -p errors
mv logs/job2.log logs/job5.log errors/
